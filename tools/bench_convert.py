"""Benchmark HF <-> mcore conversion against the disk's sequential read speed, measured in the same run.

    python tools/bench_convert.py                      # ~2 GB bf16 Qwen3-MoE-shaped model under /tmp
    python tools/bench_convert.py --size-gb 0.5 --dir checkpoints --nproc 2 --keep
    python tools/bench_convert.py --fastio             # the conversions on the fast-I/O path

Steps (all timed, page cache of the files evicted before each read-bound step with
posix_fadvise(DONTNEED) after fsync, so reads come from the disk, not from memory):
1. write a synthetic random HF checkpoint (Qwen3-MoE family, the tensor sizes of Qwen3-30B-A3B or
   --shape small, layer count scaled to --size-gb; config and tensor list from transformers, data
   random, written tensor by tensor);
2. sequential read of its safetensors files (16 MB reads) and a sequential write of as many bytes
   with fsync (conversions write what they read), each through the page cache and past it
   (O_DIRECT where the filesystem takes it, as --fastio conversions write, `fastio.direct_io`): the disk's read
   and write speeds R and W are the faster of each pair; then the same read and write at once
   (two threads, O_DIRECT): a conversion reads and writes every byte, and a disk that does one at
   a time (measured so on the CI VM, 2026-12-03) holds any conversion to 1/(1/R + 1/W);
   then a checksummed copy of the files (read through the page cache, the manifest's digest,
   write as the conversions below write, fsync; two threads):
   the per-byte work no conversion avoids, hence the most one can reach on this host;
3. for each rank count of --nproc (default 1 and 2; EP = ranks unless --ep), in fresh processes:
   `hf-to-mcore`, then `mcore-to-hf` of the result (with --fastio on the fast-I/O path,
   docs/conversion.md#fast-io): throughput = HF bytes / seconds;
and prints each throughput as a fraction of min(sequential read, sequential write), of reading and
writing at once, and of the checksummed copy's, and, for every rank, the growth of its resident
memory during the conversion (peak RSS reset before it, `tools/rss.py`) against its shard's
bytes and the I/O bucket (--io-bucket-mb).
Everything is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from megatron_sao.checkpointing.digest import DEFAULT as DEFAULT_DIGEST
from megatron_sao.checkpointing.fastio.direct_io import hashing_file as direct_hashing_file
from megatron_sao.checkpointing.fastio.direct_io import open_direct
from megatron_sao.checkpointing.hashing_file import HashingFile
from megatron_sao.checkpointing.io_bucket import DEFAULT_IO_BUCKET_BYTES
from megatron_sao.checkpointing.output_dir import human_bytes
from megatron_sao.checkpointing.safetensors_stream import StreamingSafetensorsWriter, TensorSpec
from megatron_sao.models.hf_files import TORCH_TO_ST, expected_hf_tensors

_READ_BLOCK = 16 * 1024 * 1024
SHAPES = {
    # the tensor sizes of Qwen3-30B-A3B (hidden 2048, 32 query / 4 KV heads, 768-wide experts: 3 MB
    # per expert matrix in bf16), with 32 experts per layer instead of 128 so a layer is ~0.3 GB
    "qwen3-30b-a3b": {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "num_experts": 32, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "intermediate_size": 6144},
    # smaller tensors (1 MB per expert matrix): more per-tensor overhead per byte (the stop-18/19 runs)
    "small": {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
              "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 512, "intermediate_size": 2048},
}
_LAYER_SHAPE = dict(SHAPES["qwen3-30b-a3b"])


def _layer_bytes(dtype: torch.dtype) -> int:
    s = _LAYER_SHAPE
    attention = s["hidden_size"] * s["head_dim"] * (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"])
    experts = s["num_experts"] * 3 * s["hidden_size"] * s["moe_intermediate_size"]
    return (attention + experts) * dtype.itemsize


def write_synthetic_checkpoint(directory: Path, size_bytes: float, dtype: torch.dtype, seed: int = 0) -> int:
    """A random Qwen3-MoE-shaped HF checkpoint of about `size_bytes`; returns its tensor bytes."""
    from megatron_sao.models.tiny_hf import build_tiny_tokenizer, tiny_hf_config

    layers = max(2, round(size_bytes / _layer_bytes(dtype)))
    config = tiny_hf_config("qwen3_moe", num_hidden_layers=layers, **_LAYER_SHAPE)
    config.dtype = dtype
    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    shapes = expected_hf_tensors(directory).shapes
    specs = [TensorSpec(name, TORCH_TO_ST[dtype], shape) for name, shape in shapes.items()]
    writer = StreamingSafetensorsWriter(directory, specs, max_shard_bytes=5 * 10**8)
    generator = torch.Generator().manual_seed(seed)
    for spec in specs:
        if "norm" in spec.name:
            tensor = torch.ones(spec.shape, dtype=dtype)
        else:
            tensor = (torch.randn(spec.shape, generator=generator) * 0.02).to(dtype)
        writer.write(spec.name, tensor)
    writer.close()
    return sum(s.nbytes for s in specs)


def evict(root: Path) -> None:
    """Drop `root`'s files from the page cache (after syncing them), so the next read hits the disk."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def sequential_read(files: list[Path], direct: bool = False) -> tuple[int, float]:
    """(bytes, seconds) to read `files` front to back in 16 MB blocks; with `direct`, past the page
    cache (O_DIRECT where the filesystem takes it)."""
    buffer = mmap.mmap(-1, _READ_BLOCK)  # page-aligned, as O_DIRECT needs
    total, start = 0, time.monotonic()
    for path in files:
        fd = open_direct(path, os.O_RDONLY) if direct else None
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while n := os.preadv(fd, [buffer], offset):
                offset += n
            total += offset
        finally:
            os.close(fd)
    return total, time.monotonic() - start


def _phases(result: dict) -> str:
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in result["phases"].items())


def warm_imports() -> float:
    """Import what a conversion imports, so start-up is timed on its own (seconds)."""
    start = time.monotonic()
    import megatron.core.dist_checkpointing  # noqa: F401
    import transformers  # noqa: F401

    from megatron_sao.models.bridge_compat import import_auto_bridge

    import_auto_bridge()
    return time.monotonic() - start


def sequential_write(path: Path, nbytes: int, direct: bool) -> float:
    """Seconds to write `nbytes` to `path` in 16 MB blocks and fsync (the file is removed); with
    `direct`, the way --fastio conversions write (`fastio.direct_io`: O_DIRECT where the filesystem
    takes it)."""
    block = mmap.mmap(-1, _READ_BLOCK)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(_READ_BLOCK))
    fd = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if direct else None
    if fd is None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    start = time.monotonic()
    try:
        for i in range(max(1, nbytes // _READ_BLOCK)):
            os.pwrite(fd, block, i * _READ_BLOCK)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.monotonic() - start
    path.unlink()
    return seconds


def read_and_write_at_once(files: list[Path], path: Path, nbytes: int) -> float:
    """Seconds to read `files` and write `nbytes` to `path` (+fsync) at the same time, both the
    faster way (O_DIRECT where taken), in two threads. A conversion reads and writes every byte; if
    the disk cannot do both at full speed at once (one virtual disk, one link), this and not
    min(read, write) is the most a conversion can reach."""
    import threading

    seconds: list[float] = []
    writer = threading.Thread(target=lambda: seconds.append(sequential_write(path, nbytes, direct=True)))
    start = time.monotonic()
    writer.start()
    sequential_read(files, direct=True)
    writer.join()
    if not seconds:
        raise RuntimeError(f"the write probe of {path} failed (its error is above)")
    return time.monotonic() - start


def checksummed_copy(files: list[Path], destination: Path, fastio: bool, algorithm: str = DEFAULT_DIGEST) -> float:
    """Seconds to copy `files` into one file with the manifest's digest of every byte and fsync,
    reading and writing in two threads, written the way the conversions write (`HashingFile`; with
    `fastio`, `fastio.direct_io.hashing_file`):
    what any conversion must at least do per byte (read, hash, write), and so the most a conversion
    can reach on this host (the file is removed)."""
    import queue
    import threading

    blocks: queue.Queue[bytes | None] = queue.Queue(maxsize=4)

    def read() -> None:
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while block := f.read(_READ_BLOCK):
                    blocks.put(block)
        blocks.put(None)

    start = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out = direct_hashing_file(destination, algorithm) if fastio else HashingFile(destination, algorithm)
    while (block := blocks.get()) is not None:
        out.write(block)
    out.finish()
    reader.join()
    seconds = time.monotonic() - start
    destination.unlink()
    return seconds


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _report(direction: str, layout_text: str, nproc: int, model_bytes: int, bound: float, ceiling: float,
            per_rank: list[dict], bucket: int, duplex: float) -> None:
    seconds = per_rank[0]["seconds"]
    speed = model_bytes / seconds
    cpu = sum(r["cpu_seconds"] for r in per_rank)
    print(f"{direction} [{layout_text}, {nproc} rank(s)]: {seconds:.2f} s = {human_bytes(speed)}/s = "
          f"{speed / bound:.2f} x min(read, write) = {speed / duplex:.2f} x read and write at once = "
          f"{speed / ceiling:.2f} x the checksummed copy  "
          f"({_phases(per_rank[0])}); CPU {cpu:.1f} s over all ranks "
          f"and threads = {cpu / (model_bytes / 1e9):.1f} CPU-s/GB, {cpu / seconds:.2f} of {os.cpu_count()} cores busy")
    for rank, r in enumerate(per_rank):
        grown = r["rss_peak"] - r["rss_start"]
        shard = r["shard_bytes"]
        print(f"  rank {rank}: peak RSS {human_bytes(r['rss_peak'])} = {human_bytes(r['rss_start'])} at start + "
              f"{human_bytes(grown)} = {grown / max(shard, 1):.2f} x its shard ({human_bytes(shard)}); over the "
              f"shard: {human_bytes(grown - shard)} = {(grown - shard) / bucket:.2f} x the I/O bucket"
              + ("" if r["rss_peak_reset"] else " (peak not resettable here: lifetime peak)"))
        print(f"    CPU {r['cpu_seconds']:.2f} s, of it kernel {r['kernel_cpu_seconds']:.2f} s; memory touched "
              f"fresh (page faults): {human_bytes(r['faulted_bytes'])} = {r['faulted_bytes'] / max(shard, 1):.2f} "
              "x its shard")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0, help="model size (default 2.0)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b",
                        help="tensor sizes of the synthetic model (default: those of Qwen3-30B-A3B)")
    parser.add_argument("--dir", default=None, help="where to work (default: the system temp dir, e.g. /tmp)")
    parser.add_argument("--nproc", default="1,2",
                        help="comma-separated rank counts to convert with, each in fresh processes (default 1,2)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the rank count)")
    parser.add_argument("--io-bucket-mb", type=float, default=DEFAULT_IO_BUCKET_BYTES / 2**20,
                        help=f"I/O bucket per rank (default {DEFAULT_IO_BUCKET_BYTES // 2**20})")
    parser.add_argument("--fastio", action="store_true",
                        help="convert on the fast-I/O path (`sao convert --fastio`; default: the standard path)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    args = parser.parse_args()

    from rss import measured  # tools/rss.py (this script's directory is on sys.path)

    from megatron_sao.checkpointing.hf_to_mcore import HfToMcoreRequest, convert_hf_to_mcore
    from megatron_sao.checkpointing.mcore_to_hf import McoreToHfRequest, convert_mcore_to_hf
    from megatron_sao.checkpointing.model_setup import Layout
    from megatron_sao.platform import run_distributed

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    _LAYER_SHAPE.clear()
    _LAYER_SHAPE.update(SHAPES[args.shape])
    bucket = int(args.io_bucket_mb * 2**20)
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sao-bench-convert-", dir=args.dir))
    try:
        start = time.monotonic()
        model_bytes = write_synthetic_checkpoint(work / "hf", args.size_gb * 1e9, dtype)
        files = sorted((work / "hf").glob("*.safetensors"))
        print(f"synthetic checkpoint: {human_bytes(model_bytes)} in {len(files)} files ({args.dtype}, "
              f"{args.shape} tensor sizes), "
              f"written in {time.monotonic() - start:.1f} s under {work}")
        # the disk's speed is the faster of the two ways to move its bytes: through the page cache
        # and past it (O_DIRECT, as conversions write and read HF tensors where the filesystem allows)
        evict(work)
        read_bytes, buffered_read_s = sequential_read(files)
        evict(work)
        _, direct_read_s = sequential_read(files, direct=True)
        read_s = min(buffered_read_s, direct_read_s)
        read_speed = read_bytes / read_s
        print(f"sequential read: {human_bytes(read_bytes)} in {read_s:.2f} s = {human_bytes(read_speed)}/s "
              f"(the faster of: through the page cache {human_bytes(read_bytes / buffered_read_s)}/s, "
              f"O_DIRECT {human_bytes(read_bytes / direct_read_s)}/s)")
        buffered_write_s = sequential_write(work / "write_probe", model_bytes, direct=False)
        direct_write_s = sequential_write(work / "write_probe", model_bytes, direct=True)
        write_s = min(buffered_write_s, direct_write_s)
        write_speed = model_bytes / write_s
        print(f"sequential write (+fsync): {human_bytes(model_bytes)} in {write_s:.2f} s = "
              f"{human_bytes(write_speed)}/s (the faster of: through the page cache "
              f"{human_bytes(model_bytes / buffered_write_s)}/s, "
              f"O_DIRECT {human_bytes(model_bytes / direct_write_s)}/s)")
        if not hasattr(os, "O_DIRECT"):
            print("(no O_DIRECT here: both figures went through the page cache)")
        bound = min(read_speed, write_speed)
        print(f"bound min(read, write) = {human_bytes(bound)}/s (a conversion writes as many bytes as it reads)")
        evict(work)
        both_s = read_and_write_at_once(files, work / "write_probe", model_bytes)
        duplex = model_bytes / both_s
        one_at_a_time = 1 / (1 / read_speed + 1 / write_speed)
        print(f"read and write at once: {human_bytes(model_bytes)} each way in {both_s:.2f} s = "
              f"{human_bytes(duplex)}/s = {duplex / bound:.2f} x min(read, write) (1/(1/R + 1/W) = "
              f"{one_at_a_time / bound:.2f} x if the disk does one at a time): the most a conversion, "
              "reading and writing every byte, can reach")
        evict(work)
        copy_s = checksummed_copy(files, work / "copy_probe", args.fastio)
        print(f"checksummed copy (read + {DEFAULT_DIGEST} + write + fsync, 2 threads): {copy_s:.2f} s = "
              f"{human_bytes(model_bytes / copy_s)}/s = {model_bytes / copy_s / bound:.2f} x min(read, write): "
              "the per-byte work every conversion does, so its ceiling on this host")
        # each rank imports the conversion stack before its baseline is taken (rss.warm_up): the
        # memory reported is what the conversion holds, not the libraries' one-off ~200 MB
        rank_job = partial(measured, warm_dir=work / "hf")
        print(f"I/O bucket per rank: {human_bytes(bucket)}; conversions on the "
              f"{'fast-I/O (--fastio)' if args.fastio else 'standard'} path")
        for nproc in (int(n) for n in args.nproc.split(",")):
            layout = Layout(tp=args.tp, pp=args.pp, ep=args.ep if args.ep is not None else nproc)
            mcore, hf_out = work / f"mcore_{nproc}", work / f"hf_out_{nproc}"
            evict(work)
            up = run_distributed(rank_job, nproc, convert_hf_to_mcore, HfToMcoreRequest(
                hf_dir=work / "hf", out_dir=mcore, layout=layout, progress=False, io_bucket_bytes=bucket,
                fastio=args.fastio),
                timeout_s=24 * 3600)
            ceiling = model_bytes / copy_s
            _report("hf-to-mcore", layout.describe(), nproc, model_bytes, bound, ceiling, up, bucket, duplex)
            evict(work)
            down = run_distributed(rank_job, nproc, convert_mcore_to_hf, McoreToHfRequest(
                mcore_dir=mcore, out_dir=hf_out, layout=layout, progress=False, fastio=args.fastio),
                timeout_s=24 * 3600)
            _report("mcore-to-hf", layout.describe(), nproc, model_bytes, bound, ceiling, down, bucket, duplex)
            if not args.keep:
                shutil.rmtree(mcore, ignore_errors=True)
                shutil.rmtree(hf_out, ignore_errors=True)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # run_distributed spawns ranks that re-import __main__
    main()
