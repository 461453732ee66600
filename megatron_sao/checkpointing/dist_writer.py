"""torch_dist save with memory bounded by the rank's shard plus an I/O bucket.

Measured on Megatron-Core 0.19.2 (docs/conversion.md#memory-and-streaming):
- Save. `FileSystemWriterAsync.prepare_write_data` clones every tensor that is a view of a larger
  storage (torch.save would write the whole storage), all of them before the first byte is
  written. A gated MLP stores [gate; up] as one `linear_fc1` and saves the halves as two views, so
  the clones are ~2/3 of an MoE shard: peak 1.65x the shard. It also returns its results through
  a `multiprocessing.Manager` queue, a spawned process that re-imports the caller's `__main__`
  (seconds on a small host, on every save).

`BoundedSaveStrategy` runs Megatron's own save plan (MCoreSavePlanner, the same `__<rank>_<i>.distcp`
files and metadata: any torch_dist reader reads the result) with `StreamingWriter`, whose threads
each write one file item by item, staging (cloning, or copying to host) an item only just before
writing it and only while a shared byte budget (the I/O bucket) allows. Each thread hashes its file
as it writes (`hashing_file.HashingFile`; with fast I/O `fastio.direct_io.hashing_file`: O_DIRECT
where the filesystem takes it, else through the page cache with its write-back started item by
item). Given a `fill` function and its `FillTracker`, the strategy plans the save (shapes only),
starts the writers, and runs `fill` (a conversion's load) on the calling thread while they write:
each writer waits for each item's tensor to be filled, and writes its items in fill order; with
fast I/O and a tracker, a tensor's whole pages go back to the OS once all of this rank's items of
it are written (`fastio.page_release`). The load side is `dist_reader`.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    FileSystemWriterAsync,
    _item_size,
    _split_by_size_and_type,
)
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
from torch.distributed.checkpoint.planner import WriteItemType
from torch.utils.serialization import config as serialization_config

from megatron_sao.checkpointing.fill_tracker import FillTracker
from megatron_sao.checkpointing.hashing_file import HashingFile
from megatron_sao.checkpointing.io_bucket import ByteBudget

OnBytes = Callable[[int], None]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_WRITE_KWARGS: dict[str, Any] = {}
if "serialization_format" in inspect.signature(_write_item).parameters:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    _WRITE_KWARGS["serialization_format"] = SerializationFormat.TORCH_SAVE


def _split_in_fill_order(thread_count: int, items: list[Any], planner: Any,
                         tracker: FillTracker) -> list[list[Any]]:
    """Items per thread, each list in fill order (byte items first), bytes balanced greedily."""
    tensors = [item for item in items if item.type != WriteItemType.BYTE_IO]
    buckets: list[list[Any]] = [[] for _ in range(thread_count)]
    buckets[0] = [item for item in items if item.type == WriteItemType.BYTE_IO]
    load = [0] * thread_count
    keyed = [(tracker.position(planner.resolve_data(item)), i, item) for i, item in enumerate(tensors)]
    for _, _, item in sorted(keyed, key=lambda k: k[:2]):
        target = min(range(thread_count), key=lambda t: (load[t], t))
        buckets[target].append(item)
        load[target] += _item_size(item)
    return buckets


class StreamingWriter(FileSystemWriterAsync):
    """One file per thread, written item by item; see the module docstring."""

    def __init__(self, path: str | Path, thread_count: int, budget: ByteBudget, on_bytes: OnBytes | None,
                 tracker: FillTracker | None = None, fastio: bool = False) -> None:
        super().__init__(str(path), thread_count=thread_count)
        self.budget = budget
        self.on_bytes = on_bytes
        self.tracker = tracker
        self.fastio = fastio
        self.release_written = fastio and tracker is not None
        """Give each tracked tensor's memory back once written (the tracker names the tensor of each item)."""
        self.released_bytes = 0
        """Bytes of memory given back to the OS after their tensors were written (`release_written`)."""
        self._unwritten_items: dict[int, int] = {}
        self._release_lock = threading.Lock()
        self.files: dict[str, tuple[int, str]] = {}
        """file name -> (bytes, digest hex) of the files this rank wrote (`hashing_file`)."""
        self.planned_bytes = 0
        self._results: list[Any] = []
        self._failed = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Any] = []

    def prepare_write_data(self, plan: Any, planner: Any) -> None:
        prefix = plan.storage_data.prefix
        self.write_buckets = []
        split = _split_in_fill_order(self.thread_count, plan.items, planner, self.tracker) if self.tracker \
            else _split_by_size_and_type(self.thread_count, plan.items)
        for i, items in enumerate(split):
            if items:
                name = f"{prefix}{i}{DEFAULT_SUFFIX}"
                data = [(item, planner.resolve_data(item)) for item in items]  # views stay views
                self.write_buckets.append((os.path.join(self.checkpoint_dir, name), name, data))
        self.planned_bytes = sum(_nbytes(obj) for _, _, data in self.write_buckets for item, obj in data
                                 if item.type != WriteItemType.BYTE_IO)
        if self.release_written:
            for _, _, data in self.write_buckets:
                for item, obj in data:
                    span = self.tracker.span(obj) if item.type != WriteItemType.BYTE_IO and obj.numel() else None
                    if span is not None:
                        self._unwritten_items[span] = self._unwritten_items.get(span, 0) + 1
        self.results_queue = None

    def write_all(self) -> None:
        self.start()
        self.join()

    def start(self) -> None:
        """Start one thread per file (returns at once)."""
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.write_buckets)),
                                        thread_name_prefix="sao-torch-dist-write")
        self._futures = [self._pool.submit(self._write_file, *bucket) for bucket in self.write_buckets]

    def join(self) -> None:
        """Wait for every file; the first error is raised, after the other threads stopped."""
        assert self._pool is not None, "join() before start()"
        try:
            results = [f.result() for f in self._futures]
        except BaseException:  # a failed thread, or an interrupt: the others stop at their next item
            self._failed.set()
            raise
        finally:
            self._pool.shutdown(wait=True)
        self._results = [r for file_results in results for r in file_results]

    def stop(self) -> None:
        """Make every thread stop at its next item, and wait for them (their errors are dropped)."""
        self._failed.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _write_file(self, path: str, name: str, data: list[tuple[Any, Any]]) -> list[Any]:
        results = []
        transforms = [self.transforms] if hasattr(self, "transforms") else []
        # torch.save's zip CRC32 of every record costs ~0.55 s/GB of CPU here and no reader checks
        # it (torch.load does not); the file's digest computed while writing covers every byte.
        # The setting is per thread.
        serialization_config.save.compute_crc32 = False
        if self.fastio:
            from megatron_sao.checkpointing.fastio.direct_io import hashing_file

            stream = hashing_file(path)
        else:
            stream = HashingFile(path)
        try:
            for item, obj in data:
                if self._failed.is_set():
                    raise RuntimeError("the torch_dist save of this rank was interrupted or another writer failed")
                if item.type == WriteItemType.BYTE_IO:
                    results.append(_write_item(*transforms, stream, obj, item, name, **_WRITE_KWARGS))
                    continue
                tensor = obj.detach()
                if self.tracker is not None:
                    self.tracker.wait(tensor)
                nbytes = _nbytes(tensor)
                on_host = tensor.device.type == "cpu"
                copy = not on_host or tensor.untyped_storage().nbytes() != nbytes
                with self.budget.hold(nbytes if copy else 0):
                    staged = tensor.clone() if on_host and copy else tensor.to("cpu")
                    results.append(_write_item(*transforms, stream, staged, item, name, **_WRITE_KWARGS))
                    del staged
                if self.release_written:
                    self._item_written(tensor)
                stream.kick()
                if self.on_bytes is not None:
                    self.on_bytes(nbytes)
            self.files[name] = stream.finish()
        except BaseException:
            self._failed.set()
            stream.close()
            raise
        return results

    def _item_written(self, tensor: torch.Tensor) -> None:
        """Once every item of a tracked tensor is on its way to disk, give its memory back."""
        span = self.tracker.span(tensor) if tensor.numel() else None
        if span is None:
            return
        with self._release_lock:
            self._unwritten_items[span] -= 1
            last = self._unwritten_items[span] == 0
        if last:
            from megatron_sao.checkpointing.fastio.page_release import release_pages

            released = release_pages(*self.tracker.extent(span))
            with self._release_lock:
                self.released_bytes += released

    def retrieve_write_results(self) -> list[Any]:
        return self._results


class BoundedSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist save (same plan, files and metadata) through `StreamingWriter`."""

    def __init__(self, thread_count: int, bucket_bytes: int, on_bytes: OnBytes | None = None,
                 on_planned: OnBytes | None = None, fill: Callable[[], None] | None = None,
                 tracker: FillTracker | None = None, fastio: bool = False) -> None:
        super().__init__(backend="torch_dist", thread_count=thread_count)
        if (fill is None) != (tracker is None):
            raise ValueError("fill and tracker come together: the writers wait for what fill fills")
        self.bucket_bytes = bucket_bytes
        self.on_bytes = on_bytes
        self.on_planned = on_planned
        self.fill = fill
        self.tracker = tracker
        self.fastio = fastio
        """Fast I/O: O_DIRECT writes, and (with a tracker) each filled tensor's memory given back once
        written (the model is not used after the save)."""
        self.files: dict[str, tuple[int, str]] = {}
        self.budget_peak = 0
        self.released_bytes = 0

    def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
        state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        budget = ByteBudget(self.bucket_bytes)
        writer = StreamingWriter(checkpoint_dir, self.thread_count, budget, self.on_bytes, self.tracker,
                                 fastio=self.fastio)
        planner = MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                   flatten_state_dict=False, flatten_sharded_tensors=False)
        finalize_args = save_state_dict_async_plan(mcore_to_pyt_state_dict(state, False), writer, None, 0,
                                                   planner=planner)[0]
        if self.on_planned is not None:
            self.on_planned(writer.planned_bytes)
        writer.start()
        if self.fill is not None:
            try:
                self.fill()
            except BaseException as error:
                self.tracker.fail(error)
                writer.stop()
                raise
        writer.join()
        save_state_dict_async_finalize(*finalize_args)
        self.files = dict(writer.files)
        self.budget_peak = budget.peak
        self.released_bytes = writer.released_bytes
