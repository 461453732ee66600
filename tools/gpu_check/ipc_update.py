"""Check (c): the CPU engine on the GPU machine receives a weight update by CUDA IPC from the
trainer's process, bit for bit.

The engine (`python -m megatron_sao.cpu_engine`, its own process) serves a random tiny
Qwen3-MoE checkpoint. This process is the trainer: one rank (NCCL), the actor built from that
checkpoint on the GPU in bf16 (`models.build_model`), every parameter moved by random noise; the
project's HF exporter (`models.hf_export.HFWeightExporter`, what weight sync streams) yields the
HF-named tensors on the GPU, and they go to the engine as CUDA IPC handles
(`/update_weights_from_tensor`, `load_format="torch_ipc"`, rollout/ipc_payload.py) inside a
weight-update session where the engine has one. The engine maps the trainer's GPU memory and
copies into its model (held in host memory: the CPU engine computes on the CPU). PASS: every
tensor read back (`/get_weights_by_name`) equals the exported one, and one read before the update
did not (the check can fail).

    python tools/gpu_check/ipc_update.py          # on the GPU (tools/gpu_check.sh)
    python tools/gpu_check/ipc_update.py --dry    # CPU: a safetensors payload instead of IPC handles
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import out_dir, python_cmd, quiet_libraries, report

LABEL = "(c)"


def start_engine(hf: Path, port: int, log: Path) -> subprocess.Popen:
    import httpx

    cmd = [*python_cmd(), "-m", "megatron_sao.cpu_engine", "--model", str(hf), "--port", str(port),
           "--weight-version", "0", "--log-file", str(log)]
    engine = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("a"))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if engine.poll() is not None:
            raise RuntimeError(f"the CPU engine exited with {engine.returncode} (log: {log})")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return engine
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    engine.kill()
    raise RuntimeError(f"the CPU engine did not answer /health within 180 s (log: {log})")


def readback(url: str, name: str) -> list:
    import httpx

    answer = httpx.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}, timeout=60)
    answer.raise_for_status()
    return answer.json()


def push(url: str, payload: str, load_format: str) -> tuple[dict, bool]:
    """begin / update / end; returns the update's answer and whether the engine has sessions."""
    import httpx

    begin = httpx.post(url + "/begin_weight_update", json={"selector": "all"}, timeout=60)
    sessions = begin.status_code != 404  # an engine before sglang 0.5.23's session semantics has none
    if sessions:
        begin.raise_for_status()
    answer = httpx.post(url + "/update_weights_from_tensor", timeout=300, json={
        "serialized_named_tensors": [payload], "load_format": load_format, "flush_cache": False,
        "weight_version": "1"})
    if sessions:
        httpx.post(url + "/end_weight_update", json={}, timeout=60).raise_for_status()
    return {"status": answer.status_code, **answer.json()}, sessions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU: safetensors payload instead of CUDA IPC")
    args = parser.parse_args()
    quiet_libraries()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the engine (finally below)
    import torch

    gpu = not args.dry
    if gpu and not torch.cuda.is_available():
        return report("ipc_update", LABEL, False, "no CUDA device", {})
    from megatron_sao.config import load_config
    from megatron_sao.models import build_model
    from megatron_sao.models.hf_export import HFWeightExporter
    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.platform.distributed import free_port
    from megatron_sao.rollout.ipc_payload import TORCH_IPC_LOAD_FORMAT, encode_torch_ipc_payload
    from megatron_sao.rollout.weight_transfer import SAFETENSORS_LOAD_FORMAT, encode_safetensors_payload

    work = Path(tempfile.mkdtemp(prefix="gpu_check_c_"))
    hf = build_tiny_hf_checkpoint(work / "hf", seed=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = start_engine(hf, port, out_dir() / "ipc_update.log")  # beside this check's own output
    try:
        config = load_config(None, [f"model.hf_path={hf}", f"model.dtype={'bfloat16' if gpu else 'float32'}",
                                    "logging.param_table=false"])
        init_model_parallel(config.parallelism, seed=0)
        chunks = build_model(config, "actor").chunks
        generator = torch.Generator(device=next(chunks[0].parameters()).device).manual_seed(1)
        with torch.no_grad():
            for p in (p for chunk in chunks for p in chunk.parameters()):
                p.add_(0.01 * torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype))
        exported = dict(HFWeightExporter(chunks, hf).stream(cpu=not gpu))
        probe = next(iter(exported))
        before = torch.tensor(readback(url, probe), dtype=torch.float32)
        start = time.perf_counter()
        if gpu:
            payload, keep = encode_torch_ipc_payload(exported)
            answer, sessions = push(url, payload, TORCH_IPC_LOAD_FORMAT)
            del keep  # the engine has copied (it answered)
        else:
            answer, sessions = push(url, encode_safetensors_payload(exported), SAFETENSORS_LOAD_FORMAT)
        update_s = time.perf_counter() - start
        mismatched = [n for n, t in exported.items()
                      if not torch.equal(torch.tensor(readback(url, n), dtype=torch.float32), t.float().cpu())]
    finally:
        engine.terminate()
        engine.wait(timeout=60)
    moved = not torch.equal(before, exported[probe].float().cpu())
    devices = sorted({str(t.device) for t in exported.values()})
    nbytes = sum(t.numel() * t.element_size() for t in exported.values())
    ok = answer["status"] == 200 and not mismatched and moved and (devices == ["cuda:0"] or not gpu)
    line = (f"{len(exported)} HF tensors ({nbytes / 2**20:.1f} MiB, {', '.join(devices)}) as "
            f"{'CUDA IPC handles' if gpu else 'safetensors'} in {update_s:.2f} s"
            f"{' inside a begin/end session' if sessions else ''}: engine answered {answer['status']} "
            f"({answer.get('message', '')!r}); read back {len(exported) - len(mismatched)}/{len(exported)} equal"
            f"{'' if moved else '; the probe tensor did not change (nothing to detect)'}")
    figures = {"tensors": len(exported), "bytes": nbytes, "update_s": update_s, "sessions": sessions,
               "answer": answer, "mismatched": mismatched[:20], "devices": devices}
    return report("ipc_update", LABEL, ok, line, figures, dry=args.dry)


if __name__ == "__main__":
    raise SystemExit(main())
