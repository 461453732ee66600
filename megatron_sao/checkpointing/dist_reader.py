"""torch_dist load into the model's own memory, optionally in the background while the caller
reads the parameters as they complete.

Measured on Megatron-Core 0.19.2 (docs/conversion.md#memory-and-streaming): a gated MLP's fc1 is
saved as two halves, and the load's ShardedTensorFactory `torch.cat`s them back into a new tensor
for every fc1, all held until the state dict is copied into the model: ~2/3 of an MoE shard
extra. The halves are loaded into views of the parameter, so `merge_in_place` lets the merge
return the parameter itself. The files are read by torch's own `FileSystemReader`, or, on the
fast-I/O path, by `fastio.distcp_reader.ParallelFileReader` (`FastLoad`).

With a `FillTracker`, `CountingLoadStrategy` returns as soon as the load is planned (every
collective of `dist_checkpointing.load` has run by then) and reads on a thread: each parameter is
marked once every item that writes into it has been copied, so a caller (`mcore-to-hf`'s export)
can read it while the rest loads. This needs every loaded tensor to lie inside a tracked
parameter (the objects, `_extra_state`, are read first, in the foreground); otherwise the whole
load runs in the foreground as before.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from megatron_sao.checkpointing.fill_tracker import FillTracker

if TYPE_CHECKING:
    from megatron_sao.checkpointing.fastio.distcp_reader import FastLoad

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
    """Megatron's torch_dist load, reporting the bytes of every tensor it fills (progress); with a
    `tracker`, in the background when it can (module docstring): `background` is then the running
    load. The files are read by torch's `FileSystemReader`, or with `fast` by its reader."""

    def __init__(self, on_bytes: OnBytes | None, tracker: FillTracker | None = None,
                 fast: FastLoad | None = None) -> None:
        super().__init__()
        self.on_bytes = on_bytes
        self.tracker = tracker
        self.fast = fast
        self.background: BackgroundLoad | None = None

    def load(self, sharded_state_dict: Any, checkpoint_dir: Path, async_strategy: str = "mcore") -> Any:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        original = sharded_state_dict
        state, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state = mcore_to_pyt_state_dict(state, True)
        in_background = self.tracker is not None and all(
            t.data is not None and (t.data.numel() == 0 or self.tracker.span(t.data) is not None) for t in tensors)

        def read(part: dict[str, Any], tracker: FillTracker | None, reader: Any) -> None:
            planner = _CountingLoadPlanner(
                shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
                allow_shape_mismatch_sharded_tensors={t.key: t for t in tensors if t.allow_shape_mismatch},
                flatten_state_dict=False, flatten_sharded_tensors=False, on_bytes=self.on_bytes, tracker=tracker)
            checkpoint.load(part, reader, planner=planner, no_dist=True)

        def reader(background: bool) -> Any:
            return FileSystemReader(checkpoint_dir) if self.fast is None else self.fast.reader(checkpoint_dir,
                                                                                                background)

        if in_background:
            # the objects (`_extra_state`: a few bytes each) now, the tensors on the load's thread; the
            # objects' planner validates every tensor's shape too, so a mismatch fails before returning
            objects = {k: v for k, v in pyt_state.items() if isinstance(v, io.BytesIO)}
            if objects:
                read(objects, None, FileSystemReader(checkpoint_dir))
                pyt_state.update(objects)
            tensor_part = {k: v for k, v in pyt_state.items() if k not in objects}
            self.background = BackgroundLoad(lambda: read(tensor_part, self.tracker, reader(background=True)),
                                             self.tracker)
            self.background.start()
        else:
            read(pyt_state, None, reader(background=False))
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
