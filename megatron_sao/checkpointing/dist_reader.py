"""torch_dist load into the model's own memory, optionally in the background while the caller
reads the parameters as they complete.

Measured on Megatron-Core 0.19.2 (docs/conversion.md#memory-and-streaming): a gated MLP's fc1 is
saved as two halves, and the load's ShardedTensorFactory `torch.cat`s them back into a new tensor
for every fc1, all held until the state dict is copied into the model: ~2/3 of an MoE shard
extra. The halves are loaded into views of the parameter, so `merge_in_place` lets the merge
return the parameter itself. torch's FileSystemReader reads the `.distcp` files one after the
other, each item through `torch.load`; `ParallelFileReader` reads them in parallel, and reads a
tensor item straight into its target where it can (`distcp_items`).

With a `FillTracker`, `CountingLoadStrategy` returns as soon as the load is planned (every
collective of `dist_checkpointing.load` has run by then) and reads on a thread: each parameter is
marked once every item that writes into it has been copied, so a caller (`mcore-to-hf`'s export)
can read it while the rest loads. This needs every loaded tensor to lie inside a tracked
parameter (the objects, `_extra_state`, are read first, in the foreground); otherwise the whole
load runs in the foreground as before.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from megatron_sao.checkpointing.distcp_items import storage_range
from megatron_sao.checkpointing.distcp_stream import FileDigests, StreamItem, stream_file
from megatron_sao.checkpointing.fill_tracker import FillTracker
from megatron_sao.checkpointing.load_window import LoadWindow

OnBytes = Callable[[int], None]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _CountingLoadPlanner(MCoreLoadPlanner):
    """Reports the bytes of each item copied (progress) and, with a tracker, marks each tracked
    tensor once the last item writing into it is copied (items are copied on reader threads)."""

    def __init__(self, *args: Any, on_bytes: OnBytes | None, tracker: FillTracker | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_bytes = on_bytes
        self.tracker = tracker
        self._pending: dict[int, int] = {}
        """tracked span -> items still to copy into it."""
        self._lock = threading.Lock()

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        if self.tracker is not None:
            for item in plan.items:
                if item.type != LoadItemType.BYTE_IO:
                    span = self.tracker.span(self.lookup_tensor(item.dest_index))
                    if span is not None:
                        self._pending[span] = self._pending.get(span, 0) + 1
        return plan

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if self.on_bytes is not None:
            self.on_bytes(_nbytes(tensor))
        if self.tracker is not None:
            span = self.tracker.span(tensor)
            if span is not None:
                with self._lock:
                    self._pending[span] -= 1
                    done = self._pending[span] == 0
                if done:
                    self.tracker.mark(tensor)


class ParallelFileReader(FileSystemReader):
    """torch's FileSystemReader with one thread per file (up to `thread_count`), each reading its
    file's items in offset order, and each tensor item that is its target's whole chunk read with
    `preadv` straight into the target (`distcp_items.storage_range`) instead of `torch.load` plus a
    copy (~7x less CPU per byte); other items (a slice of a saved chunk when the layout changed, a
    dtype change, objects) go through torch's reader as before. torch reads the files one after
    the other; the threads overlap one file's CPU work with the other's disk reads. With a
    `window`, each such read first waits for room in it (`load_window`). The files `digests` wants
    (even those with nothing for this rank) are read whole in one pass that hashes them and fills
    their raw items (`distcp_stream`), instead of a second read by a checksum thread."""

    def __init__(self, path: str | Path, thread_count: int, window: LoadWindow | None = None,
                 digests: FileDigests | None = None) -> None:
        super().__init__(path)
        self.thread_count = max(1, thread_count)
        self.window = window
        self.digests = digests
        self.raw_items = 0
        """Tensor items read straight into their target (the rest: `torch.load`)."""
        self._count_lock = threading.Lock()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name in self.digests.wanted if self.digests is not None else ():
            per_file.setdefault(name, [])
        hashed = self.digests.wanted if self.digests is not None else {}
        # files read in part first (e.g. the replicated tensors another rank saved): they are quick,
        # and a whole-file pass started first would keep the export waiting for them
        files = [(name, sorted(items, key=lambda i: self.storage_data[i.storage_index].offset))
                 for name, items in sorted(per_file.items(), key=lambda entry: entry[0] in hashed)]
        if len(files) <= 1 or self.thread_count == 1:
            for name, items in files:
                self._read_file(name, items, plan, planner)
        else:
            with ThreadPoolExecutor(max_workers=min(self.thread_count, len(files)),
                                    thread_name_prefix="sao-torch-dist-read") as pool:
                for future in [pool.submit(self._read_file, name, items, plan, planner) for name, items in files]:
                    future.result()
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_file(self, relative: str, items: list[ReadItem], plan: LoadPlan, planner: LoadPlanner) -> None:
        path = os.path.join(self.path, relative)
        hashed = self.digests is not None and relative in self.digests.wanted
        rest: list[ReadItem] = []
        streamed: list[StreamItem] = []
        with open(path, "rb", buffering=0) as file:
            if hashed and hasattr(os, "posix_fadvise"):  # (Linux) only the probes below read through
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # the page cache: no read-ahead
            for item in items:
                found = self._raw_target(file.fileno(), item, planner)
                if found is None:
                    rest.append(item)
                elif hashed:
                    streamed.append(_stream_item(item, *found, planner))
                else:
                    self._fill(file.fileno(), path, item, *found, planner)
        if hashed:
            assert self.digests is not None
            self.digests.found[relative] = stream_file(path, streamed, self.digests.wanted[relative],
                                                       admit=self.window.admit if self.window is not None else None)
        with self._count_lock:
            self.raw_items += len(items) - len(rest)
        if rest:
            FileSystemReader.read_data(self, dataclasses.replace(plan, items=rest), planner).wait()

    def _raw_target(self, fd: int, item: ReadItem, planner: LoadPlanner) -> tuple[int, torch.Tensor] | None:
        """(where its bytes start, its target) if `item` is its target's whole saved chunk."""
        info = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or info.transform_descriptors or any(item.storage_offsets):
            return None
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != tuple(item.lengths):
            return None
        start = storage_range(fd, info.offset, info.length, target.dtype, tuple(item.lengths))
        return None if start is None else (start, target)

    def _fill(self, fd: int, path: str, item: ReadItem, start: int, target: torch.Tensor,
              planner: LoadPlanner) -> None:
        """Read `item`'s bytes at `start` straight into `target`."""
        if self.window is not None:
            self.window.admit(_nbytes(target))
        buffer = target if target.is_contiguous() else torch.empty_like(target, memory_format=torch.contiguous_format)
        view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
        while view:
            n = os.preadv(fd, [view], start)
            if n <= 0:
                raise OSError(f"{path}: ends inside tensor item {item.storage_index.fqn!r}: truncated file")
            view, start = view[n:], start + n
        if buffer is not target:
            target.copy_(buffer)
        planner.commit_tensor(item, target)


def _stream_item(item: ReadItem, start: int, target: torch.Tensor, planner: LoadPlanner) -> StreamItem:
    if target.is_contiguous():
        return StreamItem(name=item.storage_index.fqn, start=start, target=target,
                          done=lambda: planner.commit_tensor(item, target))
    buffer = torch.empty_like(target, memory_format=torch.contiguous_format)

    def done() -> None:
        target.copy_(buffer)
        planner.commit_tensor(item, target)

    return StreamItem(name=item.storage_index.fqn, start=start, target=buffer, done=done)


class BackgroundLoad:
    """The reading half of a load, on its own thread. Success or failure, it ends with
    `tracker.finish()`: every waiter is released, so collective readers of the parameters (the
    export's gathers) run to the end on every rank; `join` then raises the load's error."""

    def __init__(self, run: Callable[[], None], tracker: FillTracker) -> None:
        self._run = run
        self._tracker = tracker
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self._thread = threading.Thread(target=self._main, name="sao-torch-dist-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as e:  # raised by `join` on the calling thread
            self.error = e
        finally:
            self.finished_at = time.monotonic()
            self._tracker.finish()

    def join(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error


class CountingLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron's torch_dist load, reporting the bytes of every tensor it fills (progress), through
    `ParallelFileReader`; with a `tracker`, in the background when it can (module docstring):
    `background` is then the running load, held back by `window` if given."""

    def __init__(self, on_bytes: OnBytes | None, thread_count: int = 2, tracker: FillTracker | None = None,
                 window: LoadWindow | None = None, digests: FileDigests | None = None) -> None:
        super().__init__()
        self.on_bytes = on_bytes
        self.thread_count = thread_count
        self.tracker = tracker
        self.window = window
        self.digests = digests
        self.background: BackgroundLoad | None = None

    def load(self, sharded_state_dict: Any, checkpoint_dir: Path, async_strategy: str = "mcore") -> Any:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        original = sharded_state_dict
        state, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state = mcore_to_pyt_state_dict(state, True)
        in_background = self.tracker is not None and all(
            t.data is not None and (t.data.numel() == 0 or self.tracker.span(t.data) is not None) for t in tensors)

        def read(part: dict[str, Any], tracker: FillTracker | None, window: LoadWindow | None = None,
                 digests: FileDigests | None = None) -> None:
            planner = _CountingLoadPlanner(
                shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
                allow_shape_mismatch_sharded_tensors={t.key: t for t in tensors if t.allow_shape_mismatch},
                flatten_state_dict=False, flatten_sharded_tensors=False, on_bytes=self.on_bytes, tracker=tracker)
            checkpoint.load(part, ParallelFileReader(checkpoint_dir, self.thread_count, window, digests),
                            planner=planner, no_dist=True)

        if in_background:
            # the objects (`_extra_state`: a few bytes each) now, the tensors on the load's thread; the
            # objects' planner validates every tensor's shape too, so a mismatch fails before returning
            objects = {k: v for k, v in pyt_state.items() if isinstance(v, io.BytesIO)}
            if objects:
                read(objects, None)
                pyt_state.update(objects)
            tensor_part = {k: v for k, v in pyt_state.items() if k not in objects}
            self.background = BackgroundLoad(lambda: read(tensor_part, self.tracker, self.window, self.digests),
                                             self.tracker)
            self.background.start()
        else:
            read(pyt_state, None, digests=self.digests)
        loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, original)
        return loaded


def merge_in_place(state: dict[str, Any], tracker: FillTracker | None = None) -> None:
    """Let every ShardedTensorFactory of `state` (gated fc1: [gate; up]) return its own tensor after
    loading when the loaded parts are views covering it, instead of concatenating a copy. A merge
    that must copy waits for a background load to finish first (`tracker`): it reads the parts."""
    for value in nested_values(state):
        if isinstance(value, ShardedTensorFactory) and value.data is not None:
            value.merge_fn = _in_place(value.data, value.merge_fn, tracker)


def _in_place(data: torch.Tensor, merge: Callable[[Any], Any], tracker: FillTracker | None) -> Callable[[Any], Any]:
    def merge_fn(loaded: Any) -> Any:
        parts = loaded if isinstance(loaded, list) else [loaded]
        storage = data.untyped_storage().data_ptr()
        if (all(isinstance(p, torch.Tensor) and p.untyped_storage().data_ptr() == storage for p in parts)
                and sum(p.numel() for p in parts) == data.numel()):
            return data
        if tracker is not None:
            tracker.wait_finished()
        return merge(loaded)

    return merge_fn
