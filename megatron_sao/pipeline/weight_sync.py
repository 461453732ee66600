"""Push one version of the actor's weights into the rollout engines, in HF naming, bucket by bucket.

The trainer ranks run the collective Megatron -> HF stream (`models.hf_export.HFWeightExporter`,
gathered across TP / PP / EP); trainer rank 0 gets the buckets and hands them to every engine:
`tensor` (colocated: one `/update_weights_from_tensor` per bucket; safetensors payload for the CPU
engine, SGLang's flattened-bucket CUDA-IPC payload with `engine_format="sglang"`: engines on
trainer rank 0's node only), `distributed` (disaggregated: a process group of trainer rank 0 and
the engines, gloo on CPU, NCCL on GPU, kept across syncs; the engines are told names / dtypes /
shapes while rank 0 broadcasts) or `disk` (fallback: an HF directory `<disk_dir>/v<version>` that
every engine loads). Then the version is set on every engine and read back from `/model_info`: a
mismatch raises `WeightSyncError` naming the engine. Checksum mode compares the SHA-256 of the
export with that of what went on the wire, decoded back on the sender (engines report no weight
hash). docs/pipeline.md ("Weight sync") has the details and figures.

SGLang 0.5.23 refuses tensor and distributed updates outside a weight-update session
(`managers/scheduler_components/weight_updater.py`), so those modes run
`begin_weight_update` -> buckets -> `end_weight_update` on every engine (the end also runs the
engine's post-load processing); a failed push still ends the session it opened. Disk updates
need none (and a session around one would post-process twice).

Pause / continue is the caller's job:

    # trainer rank 0, on the rollout loop: pause_generation("in_place") on every engine, then
    report = await weight_sync.push(clients, version)   # meanwhile every other rank: weight_sync.follow()
    # then continue_generation() on every engine (RolloutService.update_weights does both)

`push` runs the collective stream on a worker thread so that the event loop keeps serving; it
drains the stream whatever fails, so the other ranks never wait in a gather. `sync()` does both
sides for callers without a running loop (tests, tools).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_sao.config.schema import WeightSyncConfig
from megatron_sao.models.hf_export import HFWeightExporter, tensor_nbytes
from megatron_sao.platform.distributed import free_port
from megatron_sao.rollout import weight_transfer as wt
from megatron_sao.utils.atomic import replace_dir

SyncMode = Literal["tensor", "distributed", "disk"]
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class WeightSyncError(RuntimeError):
    """A weight sync did not reach an engine as intended; the message names the engine."""


def check_weight_sync(config: WeightSyncConfig, disk_dir: str = "") -> None:
    """ValueError naming the `rollout.weight_sync.*` key that cannot work for a push."""
    if config.mode not in ("tensor", "distributed", "disk"):
        raise ValueError(f"rollout.weight_sync.mode must be tensor, distributed or disk here (auto is resolved "
                         f"by config.placement.weight_sync_mode), got {config.mode!r}")
    if not config.bucket_mb > 0:
        raise ValueError(f"rollout.weight_sync.bucket_mb must be > 0, got {config.bucket_mb}")
    if config.every_n_steps < 1:
        raise ValueError(f"rollout.weight_sync.every_n_steps must be >= 1, got {config.every_n_steps}")
    if config.mode == "disk" and not disk_dir:
        raise ValueError("weight sync with rollout.weight_sync.mode=disk needs a disk_dir (a directory engines read)")


def is_due(config: WeightSyncConfig, policy_version: int) -> bool:
    """Whether the actor at `policy_version` (applied updates so far) is to be pushed."""
    return policy_version > 0 and policy_version % config.every_n_steps == 0


@dataclass
class SyncReport:
    """What one sync did (rank 0); `metrics()` for the step's log."""

    version: str
    mode: str
    engines: list[str]
    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    seconds: float = 0.0
    export_seconds: float = 0.0
    """Time rank 0 waited on the collective stream (gathers and conversion)."""
    checksum: str | None = None
    path: str | None = None
    """Disk mode: the HF directory written (engine restarts can load it)."""
    flushed: bool = False
    """Whether every engine flushed its prefix cache afterwards (refused while requests are paused
    in place: their KV was computed by the old weights either way)."""
    digests: dict[str, str] = field(default_factory=dict, repr=False)

    def metrics(self) -> dict[str, float]:
        return {"weight_sync/seconds": self.seconds, "weight_sync/export_s": self.export_seconds,
                "weight_sync/bytes": float(self.num_bytes), "weight_sync/buckets": float(self.num_buckets)}


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def combine_digests(digests: Mapping[str, str]) -> str:
    return hashlib.sha256("".join(f"{n}={d};" for n, d in sorted(digests.items())).encode()).hexdigest()


def weights_checksum(named: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over HF-named tensors (name, dtype, shape, bytes), independent of their order."""
    return combine_digests({n: tensor_digest(n, t) for n, t in named.items()})


class WeightSync:
    """Trainer side of weight sync; one per run (it keeps the distributed group)."""

    def __init__(self, exporter: HFWeightExporter, config: WeightSyncConfig, *, src_rank: int = 0,
                 engine_format: Literal["safetensors", "sglang"] = "safetensors", engine_tp_size: int = 1,
                 disk_dir: str = "", master_port: int = 0, backend: Literal["auto", "gloo", "nccl"] = "auto",
                 group_name: str = wt.DEFAULT_GROUP_NAME, timeout_s: float = 600.0) -> None:
        """`config` is the run's `rollout.weight_sync` with its mode resolved (not `auto`); the rest
        is what the run knows of its engines, not configuration:

        engine_format   tensor-mode payload: safetensors (CPU engine) or SGLang's CUDA-IPC serialisation
        engine_tp_size  each engine's TP size: SGLang payload copies (tensor), group ranks per engine
                        (distributed)
        disk_dir        disk mode: a directory every engine can read, owned by weight sync (its `v*`
                        entries are replaced); required for mode=disk
        master_port     distributed mode: TCP port of the group's store on trainer rank 0 (0: a free port)
        backend         distributed mode: auto = NCCL with CUDA, gloo without
        timeout_s       distributed mode: how long a group join or a broadcast may wait for the engines
        """
        check_weight_sync(config, disk_dir)
        if engine_tp_size < 1:
            raise ValueError(f"weight sync: engine_tp_size must be >= 1, got {engine_tp_size}")
        self.exporter = exporter
        self.config = config
        self.mode: SyncMode = config.mode  # type: ignore[assignment]  # resolved: checked above
        self.src_rank = src_rank
        self.engine_format = engine_format
        self.engine_tp_size = engine_tp_size
        self.disk_dir = disk_dir
        self.master_port = master_port
        self.group_name = group_name
        self.timeout_s = timeout_s
        self._group: Any = None
        self._group_urls: tuple[str, ...] = ()
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
        self._session_open: list[Any] = []
        # Tensors stay on the GPU only for CUDA-IPC payloads and NCCL broadcasts.
        self._cpu = not ((self.mode == "tensor" and engine_format == "sglang")
                         or (self.mode == "distributed" and self._backend == "nccl"))

    @property
    def bucket_bytes(self) -> int:
        """`rollout.weight_sync.bucket_mb` in bytes: the most tensor bytes rank 0 holds and sends at
        once (one bigger tensor is a bucket of its own)."""
        return max(1, int(self.config.bucket_mb * 2**20))

    # ---- both sides ----------------------------------------------------------------------------

    def _buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.exporter.buckets(self.bucket_bytes, cpu=self._cpu, src_rank=self.src_rank)

    def follow(self) -> None:
        """Every trainer rank but `src_rank`: take part in the stream (keeps nothing)."""
        for _ in self._buckets():
            pass

    def sync(self, version: int | str, clients: Sequence[Any] = ()) -> SyncReport | None:
        """Collective, for callers without a running event loop: push on `src_rank` (its own loop),
        follow elsewhere. Returns the report on `src_rank`, None elsewhere."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank != self.src_rank:
            self.follow()
            return None
        return asyncio.run(self.push(list(clients), version))

    # ---- trainer rank 0 ------------------------------------------------------------------------

    async def push(self, clients: Sequence[Any], version: int | str) -> SyncReport:
        """On `src_rank`, inside the loop the clients belong to, while the other ranks `follow()`."""
        version = str(version)
        report = SyncReport(version=version, mode=self.mode, engines=[c.base_url for c in clients])
        start = time.perf_counter()
        buckets = self._buckets()
        sender = {"tensor": self._send_tensor, "distributed": self._send_distributed, "disk": self._send_disk}
        try:  # whatever fails, the stream is drained below: the other trainer ranks are in its gathers
            if not clients:
                raise ValueError("weight sync needs at least one engine client")
            if self.mode == "distributed":
                await self._ensure_group(clients)
            if self.mode != "disk":
                await self._begin(clients)
            await sender[self.mode](clients, self._timed(buckets, report), version, report)
            await self._end(clients, strict=True)
        except BaseException:
            await self._end(clients, strict=False)  # best effort: a session left open refuses the next begin
            await self.close_group(clients)  # a broadcast cut short leaves the group unusable
            raise
        finally:
            await asyncio.to_thread(_drain, buckets, self._device)  # keep the other ranks' collectives matched
        if self.mode != "disk":
            await _each(clients, "set the weight version",
                        lambda c: c.update_weight_version(version, abort_all_requests=False))
        got = await asyncio.gather(*(c.get_weight_version() for c in clients))
        wrong = [f"{c.base_url} reports {v!r}" for c, v in zip(clients, got, strict=True) if v != version]
        if wrong:
            raise WeightSyncError(f"weight sync to version {version!r}: {'; '.join(wrong)}")
        flushed = await asyncio.gather(*(c.flush_cache() for c in clients), return_exceptions=True)
        report.flushed = all(f is True for f in flushed)
        if self.config.checksum:
            report.checksum = combine_digests(report.digests)
        report.seconds = time.perf_counter() - start
        return report

    async def _begin(self, clients: Sequence[Any]) -> None:
        """Open a weight-update session on every engine (0.5.23 refuses tensor / distributed
        updates outside one); the engines that opened one are remembered for `_end`."""
        results = await asyncio.gather(*(c.begin_weight_update() for c in clients), return_exceptions=True)
        self._session_open = [c for c, r in zip(clients, results, strict=True) if not isinstance(r, BaseException)]
        errors = [f"{c.base_url}: {r}" for c, r in zip(clients, results, strict=True) if isinstance(r, BaseException)]
        if errors:
            raise WeightSyncError(f"weight sync: begin_weight_update failed on {len(errors)} engine(s): "
                                  + "; ".join(errors))

    async def _end(self, clients: Sequence[Any], strict: bool) -> None:
        """Close the sessions `_begin` opened (the engines finalise the loaded weights)."""
        opened, self._session_open = self._session_open, []
        if not opened:
            return
        if strict:
            await _each(opened, "end_weight_update", lambda c: c.end_weight_update())
        else:
            await asyncio.gather(*(c.end_weight_update() for c in opened), return_exceptions=True)

    async def _timed(self, buckets: Iterator[dict[str, torch.Tensor]], report: SyncReport):
        while True:
            t0 = time.perf_counter()
            bucket = await asyncio.to_thread(_next, buckets, self._device)
            report.export_seconds += time.perf_counter() - t0
            if bucket is None:
                return
            report.num_buckets += 1
            report.num_tensors += len(bucket)
            report.num_bytes += sum(tensor_nbytes(t) for t in bucket.values())
            if self.config.checksum:
                report.digests.update({n: tensor_digest(n, t) for n, t in bucket.items()})
            yield bucket

    def _check_wire(self, wire: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor], report: SyncReport,
                    what: str) -> None:
        if not self.config.checksum:
            return
        if set(wire) != set(sent):
            raise WeightSyncError(f"checksum: the {what} holds {sorted(set(wire) ^ set(sent))[:5]} unlike the export")
        for name, tensor in wire.items():
            if tensor_digest(name, tensor) != report.digests.get(name):
                raise WeightSyncError(f"checksum: {name!r} differs between the export and the {what}")

    async def _send_tensor(self, clients, buckets, version: str, report: SyncReport) -> None:
        sglang = self.engine_format == "sglang"
        async for bucket in buckets:
            if sglang:  # `flat` (what the IPC handle points at) stays alive until every engine answered
                payload, flat = wt.encode_sglang_flattened_payload(bucket, self.engine_tp_size)
            else:
                payload, flat = [await asyncio.to_thread(wt.encode_safetensors_payload, bucket)], None
                self._check_wire(wt.decode_safetensors_payload(payload[0]), bucket, report, "tensor payload")
            fmt = wt.SGLANG_FLATTENED_LOAD_FORMAT if sglang else wt.SAFETENSORS_LOAD_FORMAT
            await _each(clients, f"update_weights_from_tensor (bucket {report.num_buckets})",
                        lambda c, p=payload, f=fmt: c.update_weights_from_tensor(p, load_format=f, flush_cache=False))
            del flat, payload
            if sglang:
                torch.cuda.ipc_collect()  # give back IPC blocks the engines have closed (slime does the same)

    async def _send_distributed(self, clients, buckets, version: str, report: SyncReport) -> None:
        group = self._group
        async for bucket in buckets:
            names, tensors = list(bucket), [t.contiguous() for t in bucket.values()]
            dtypes = [wt.dtype_name(t.dtype) for t in tensors]
            shapes = [list(t.shape) for t in tensors]
            announce = _each(clients, f"update_weights_from_distributed (bucket {report.num_buckets})",
                             lambda c, n=names, d=dtypes, s=shapes: c.update_weights_from_distributed(
                                 n, d, s, group_name=self.group_name, flush_cache=False))
            await asyncio.gather(announce, asyncio.to_thread(self._broadcast, group, tensors))

    def _broadcast(self, group: Any, tensors: list[torch.Tensor]) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)
        wt.broadcast_tensors(group, tensors)  # the ProcessGroup's own broadcast: gloo and NCCL alike

    async def _send_disk(self, clients, buckets, version: str, report: SyncReport) -> None:
        from safetensors.torch import load_file, save_file

        root = Path(self.disk_dir)
        final, tmp = root / f"v{version}", root / f".v{version}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        weight_map: dict[str, str] = {}
        async for bucket in buckets:
            file = f"model-{report.num_buckets:05d}.safetensors"
            tensors = {n: t.detach().contiguous() for n, t in bucket.items()}
            await asyncio.to_thread(save_file, tensors, str(tmp / file), {"format": "pt"})
            weight_map.update(dict.fromkeys(bucket, file))
            if self.config.checksum:
                self._check_wire(await asyncio.to_thread(load_file, str(tmp / file)), bucket, report, f"shard {file}")
        index = {"metadata": {"total_size": report.num_bytes}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
        for entry in sorted(Path(self.exporter.hf_dir).iterdir()):  # config, tokenizer: a loadable HF dir
            if entry.is_file() and not entry.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(entry, tmp / entry.name)
        replace_dir(tmp, final, durable=False)  # read by the engines at once; a crash writes the next version
        report.path = str(final)
        await _each(clients, f"update_weights_from_disk ({final})",
                    lambda c: c.update_weights_from_disk(str(final), weight_version=version, flush_cache=False))
        for old in root.glob("v*"):  # engines restarted later load `final`; older versions go
            if old.is_dir() and old != final:
                shutil.rmtree(old, ignore_errors=True)

    # ---- the distributed group -------------------------------------------------------------------

    @property
    def master_address(self) -> str:
        """Where the engines reach trainer rank 0: the configured address, else MASTER_ADDR (rank 0
        hosts torch.distributed's store there, so every trainer node reaches it; Ray ranks get
        their node's address, `platform/ray_ranks.py`), else loopback (one machine)."""
        return self.config.master_address or os.environ.get("MASTER_ADDR") or "127.0.0.1"

    async def _ensure_group(self, clients: Sequence[Any]) -> None:
        urls = tuple(c.base_url for c in clients)
        if self._group is not None and urls == self._group_urls:
            return
        await self.close_group(clients)
        port = self.master_port or free_port()
        address = self.master_address
        world = 1 + len(clients) * self.engine_tp_size  # an engine joins with one rank per TP rank
        opened = asyncio.to_thread(self._open_group, address, port, world)
        joins = [c.init_weights_update_group(address, port, rank_offset=1 + i * self.engine_tp_size,
                                             world_size=world,
                                             group_name=self.group_name, backend=self._backend)
                 for i, c in enumerate(clients)]
        results = await asyncio.gather(opened, *joins, return_exceptions=True)
        errors = [f"{c.base_url}: {r}" for c, r in zip(clients, results[1:], strict=True) if isinstance(r, Exception)]
        if not isinstance(results[0], BaseException):
            self._group, self._group_urls = results[0], urls  # held from here: close_group destroys it
        if isinstance(results[0], Exception) or errors:
            raise WeightSyncError(f"opening the weight update group ({address}:{port}, {self._backend}) "
                                  f"failed: {results[0] if isinstance(results[0], Exception) else ''} {errors}")

    def _open_group(self, address: str, port: int, world: int) -> Any:
        if self._device is not None and self._backend == "nccl":
            torch.cuda.set_device(self._device)
        return wt.init_update_group(address, port, 0, world, self.group_name, self._backend,
                                    self.timeout_s)

    async def close_group(self, clients: Sequence[Any] = ()) -> None:
        """Destroy the group on both ends (engines that still answer destroy theirs; the trainer's
        end leaves torch's registry, so the next distributed push can open the same name again).
        Call after an engine restart."""
        if self._group is None:
            return
        group, self._group = self._group, None
        live = [c for c in clients if c.base_url in self._group_urls]
        self._group_urls = ()
        await asyncio.gather(*(c.destroy_weights_update_group(self.group_name) for c in live),
                             return_exceptions=True)
        await asyncio.to_thread(wt.destroy_update_group, group)


def _next(buckets: Iterator[dict[str, torch.Tensor]], device: int | None) -> dict[str, torch.Tensor] | None:
    if device is not None:
        torch.cuda.set_device(device)  # the CUDA device is per thread
    return next(buckets, None)


def _drain(buckets: Iterator[dict[str, torch.Tensor]], device: int | None) -> None:
    while _next(buckets, device) is not None:
        pass


async def _each(clients: Sequence[Any], what: str, call: Callable[[Any], Awaitable[Any]]) -> None:
    """`call` on every engine at once; any failure raises naming the engine(s)."""
    results = await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
    errors = [f"{c.base_url}: {r}" for c, r in zip(clients, results, strict=True) if isinstance(r, BaseException)]
    if errors:
        raise WeightSyncError(f"weight sync: {what} failed on {len(errors)} engine(s): " + "; ".join(errors))
