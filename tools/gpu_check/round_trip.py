"""Check (b): HF -> Megatron -> HF with the project's converter on CUDA, bit for bit.

A random bf16 Qwen3-MoE checkpoint (0.42 B parameters: 8 layers, hidden 1024, 32 experts) goes
through `sao convert hf-to-mcore` and `sao convert mcore-to-hf` in this process (one rank, NCCL,
the model built on the GPU); every tensor of the result must equal the source's in name, dtype,
shape and bytes. Figures: both conversions' seconds, the GPU memory they peaked at (evidence the
model was on the GPU), tensors and bytes compared.

    python tools/gpu_check/round_trip.py          # on the GPU (tools/gpu_check.sh)
    python tools/gpu_check/round_trip.py --dry    # CPU, the tiny checkpoint, gloo
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import gib, out_dir, quiet_libraries, report

LABEL = "(b)"

H200_MODEL = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                  num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512)


def differences(source: dict, result: dict) -> list[str]:
    """What differs between two {name: tensor} maps (names, dtypes, shapes, bytes)."""
    import torch

    out = [f"only in the source: {n}" for n in sorted(set(source) - set(result))]
    out += [f"only in the result: {n}" for n in sorted(set(result) - set(source))]
    for name in sorted(set(source) & set(result)):
        a, b = source[name], result[name]
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            out.append(f"{name}: {a.dtype} {tuple(a.shape)} became {b.dtype} {tuple(b.shape)}")
        elif not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            out.append(f"{name}: bytes differ")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU, the tiny checkpoint, gloo")
    args = parser.parse_args()
    quiet_libraries()
    import torch

    gpu = not args.dry
    if gpu and not torch.cuda.is_available():
        return report("round_trip", LABEL, False, "no CUDA device", {})
    from megatron_sao.cli import main as sao
    from megatron_sao.cpu_engine.weights import read_hf_checkpoint
    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint

    work = Path(tempfile.mkdtemp(prefix="gpu_check_b_"))
    hf = build_tiny_hf_checkpoint(work / "hf", seed=0, dtype=torch.bfloat16, **(H200_MODEL if gpu else {}))
    log = out_dir() / "round_trip.log"  # beside this check's own output (tools/gpu_check.sh)
    seconds = {}
    for name, argv in (("hf_to_mcore", ["hf-to-mcore", "--hf", str(hf), "--out", str(work / "mcore")]),
                       ("mcore_to_hf", ["mcore-to-hf", "--mcore", str(work / "mcore"), "--out", str(work / "hf2")])):
        start = time.perf_counter()
        code = sao(["convert", *argv, "--no-progress", "--log-file", str(log)])
        seconds[name] = time.perf_counter() - start
        if code != 0:
            return report("round_trip", LABEL, False, f"sao convert {argv[0]} exited {code} (log: {log})", seconds)
    source, result = read_hf_checkpoint(hf), read_hf_checkpoint(work / "hf2")
    diffs = differences(source, result)
    peak = gib(torch.cuda.max_memory_allocated()) if gpu else 0.0
    nbytes = sum(t.numel() * t.element_size() for t in source.values())
    on_gpu = peak > 0.5 * gib(nbytes) if gpu else True
    figures = {**{f"{k}_s": v for k, v in seconds.items()}, "tensors": len(source), "bytes": nbytes,
               "params": sum(t.numel() for t in source.values()), "peak_cuda_gib": peak, "differences": diffs[:20]}
    line = (f"{len(source)} tensors, {nbytes / 2**30:.2f} GiB bf16 ({figures['params'] / 1e9:.2f} B params): "
            f"{'bit-identical' if not diffs else f'{len(diffs)} differences, e.g. {diffs[0]}'}; hf-to-mcore "
            f"{seconds['hf_to_mcore']:.1f} s, mcore-to-hf {seconds['mcore_to_hf']:.1f} s; peak CUDA memory "
            f"{peak:.2f} GiB")
    if not on_gpu:
        line += " [the model did not reach the GPU]"
    return report("round_trip", LABEL, not diffs and on_gpu, line, figures, dry=args.dry)


if __name__ == "__main__":
    raise SystemExit(main())
