"""Benchmark weight sync (trainer -> rollout engine) per mode against a plain in-memory copy of the
same bytes, measured in the same run.

    python tools/bench_weight_sync.py                       # ~115 MB fp32 MoE, 2 ranks (EP2), one CPU engine
    python tools/bench_weight_sync.py --layers 2 --hidden-size 256 --nproc 1 --ep 1 --modes tensor,disk

Steps (every rank of the trainer, gloo; the CPU engine is served from rank 0's process):
1. build a random Qwen3-MoE HF checkpoint of the requested shape and the Megatron actor from it;
2. export only: the collective Megatron -> HF stream into buckets, nothing sent (the gather and
   conversion cost every mode pays);
3. the baseline: copy every exported tensor into preallocated buffers (a memcpy of the same bytes);
4. per mode (tensor, distributed, disk): one untimed sync (opens the process group, warms the
   engine), then `--repeats` timed `WeightSync.sync` calls, each ending with the engine's version
   check; the median is reported with its ratio to the copy and the share spent in the export.
The engine computes with 1 thread, so the numbers are for a 2-core box when --nproc 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_worker(hf_dir: str, overrides: list[str], modes: list[str], bucket_mb: float, repeats: int,
                 work: str) -> dict[str, Any] | None:
    import torch.distributed as dist

    from megatron_sao.config import load_config
    from megatron_sao.config.schema import WeightSyncConfig
    from megatron_sao.cpu_engine import CPUEngineConfig, ServerThread
    from megatron_sao.models import build_model
    from megatron_sao.models.hf_export import HFWeightExporter
    from megatron_sao.pipeline.weight_sync import WeightSync
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.platform.distributed import free_port
    from megatron_sao.rollout.client import EngineClient

    rank = dist.get_rank()
    config = load_config(None, [f"model.hf_path={hf_dir}", "model.dtype=float32", "logging.param_table=false",
                                f"parallelism.world_size={dist.get_world_size()}", *overrides])
    init_model_parallel(config.parallelism, seed=0)
    chunks = build_model(config, "actor").chunks
    exporter = HFWeightExporter(chunks, hf_dir)
    bucket_bytes = int(bucket_mb * 2**20)

    exported: list[dict[str, torch.Tensor]] = []

    def export_only() -> None:
        exported[:] = list(exporter.buckets(bucket_bytes))

    dist.barrier()
    export_s = _median_time(export_only, repeats)
    result: dict[str, Any] = {"export_s": export_s}
    if rank == 0:
        sources = [t for b in exported for t in b.values()]
        targets = [torch.empty_like(t) for t in sources]
        for src, dst in zip(sources, targets, strict=True):  # touch the pages once
            dst.copy_(src)

        def copy() -> None:
            for src, dst in zip(sources, targets, strict=True):
                dst.copy_(src)

        result["copy_s"] = _median_time(copy, max(repeats, 5))
        result["bytes"] = sum(t.numel() * t.element_size() for t in sources)
        result["tensors"] = len(sources)
    server = ServerThread(CPUEngineConfig(model_path=hf_dir, host="127.0.0.1", port=free_port(),
                                          weight_version="0", threads=1)).start() if rank == 0 else None
    clients = [EngineClient(server.url)] if server is not None else []
    version = 0
    try:
        for mode in modes:
            sync = WeightSync(exporter, WeightSyncConfig(mode=mode, bucket_mb=bucket_mb), disk_dir=f"{work}/disk")
            version += 1
            sync.sync(version, clients)  # untimed: opens the group, warms the engine
            reports = []
            for _ in range(repeats):
                version += 1
                dist.barrier()
                reports.append(sync.sync(version, clients))
            if rank == 0:
                result[mode] = {"seconds": statistics.median(r.seconds for r in reports),
                                "export_s": statistics.median(r.export_seconds for r in reports),
                                "buckets": reports[0].num_buckets}
    finally:
        if server is not None:
            server.stop()
    return result if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--moe-ffn", type=int, default=512)
    parser.add_argument("--bucket-mb", type=float, default=32.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="tensor,distributed,disk")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]

    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint
    from megatron_sao.platform import run_distributed

    with tempfile.TemporaryDirectory(prefix="sao-bench-sync-") as tmp:
        heads = max(1, args.hidden_size // 64)
        hf_dir = build_tiny_hf_checkpoint(
            Path(tmp) / "hf", num_hidden_layers=args.layers, hidden_size=args.hidden_size, num_experts=args.experts,
            moe_intermediate_size=args.moe_ffn, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
            head_dim=64, intermediate_size=2 * args.moe_ffn)
        overrides = [f"parallelism.expert={args.ep}", f"parallelism.tensor={args.tp}"]
        res = run_distributed(bench_worker, args.nproc, str(hf_dir), overrides, modes, args.bucket_mb, args.repeats,
                              tmp, timeout_s=3600)[0]
    copy_s, nbytes = res["copy_s"], res["bytes"]
    print(f"model: {nbytes / 2**20:.1f} MiB in {res['tensors']} HF tensors, {args.nproc} trainer ranks "
          f"(TP{args.tp} EP{args.ep}), buckets of {args.bucket_mb:g} MiB, median of {args.repeats}")
    print(f"{'what':<24}{'seconds':>10}{'GB/s':>9}{'x copy':>10}{'export share':>14}")
    print(f"{'in-memory copy':<24}{copy_s:>10.4f}{nbytes / copy_s / 1e9:>9.2f}{1.0:>10.1f}{'':>14}")
    print(f"{'export only (gather)':<24}{res['export_s']:>10.4f}{nbytes / res['export_s'] / 1e9:>9.2f}"
          f"{res['export_s'] / copy_s:>10.1f}{'':>14}")
    for mode in modes:
        m = res[mode]
        print(f"{'sync: ' + mode:<24}{m['seconds']:>10.4f}{nbytes / m['seconds'] / 1e9:>9.2f}"
              f"{m['seconds'] / copy_s:>10.1f}{m['export_s'] / m['seconds']:>13.0%} ")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, **res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
