"""When a conversion fills each Megatron parameter with NaN and when it checks that none is left,
so that an element no conversion task wrote cannot pass for a weight (see `hf_load`).

A task is one megatron-bridge conversion step: it writes (part of) one parameter, `task.param_weight`.
The fill and the check run on threads beside the task loop, which only waits for a parameter to be
filled before its first task; a parameter is checked after its last task and then marked in the
`FillTracker`, so the torch_dist writer can save it while the next ones convert.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from megatron_sao.checkpointing.fill_tracker import FillTracker

FILL_AHEAD_BYTES = 64 * 2**20


def has_nan(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 0 and bool(torch.isnan(tensor.max()))


class _FillAhead:
    """NaN-fills `tensors` in order on its own thread, ahead of the task loop: the fill is the first
    touch of the shard's memory (page faults plus a write of every byte, a third of the load's CPU
    when it ran inline), and `fill_` releases the GIL, so it runs beside megatron-bridge's loop. It
    stays at most `max_ahead_bytes` ahead of the last parameter the loop asked for (`_may_fill`)."""

    def __init__(self, tensors: list[torch.Tensor], max_ahead_bytes: int) -> None:
        self._tensors = tensors
        self._ends = list(itertools.accumulate(t.numel() * t.element_size() for t in tensors))
        self._max_ahead = max_ahead_bytes
        self._needed = -1
        """The last index the task loop has asked for."""
        self._filled = 0
        self._error: BaseException | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sao-nan-fill", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.no_grad():
                for i, tensor in enumerate(self._tensors):
                    with self._cond:
                        self._cond.wait_for(lambda i=i: self._stopped or self._may_fill(i))
                    if self._stopped:
                        return
                    tensor.fill_(float("nan"))
                    with self._cond:
                        self._filled = i + 1
                        self._cond.notify_all()
        except BaseException as e:  # reported to the task loop, which is waiting for it
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _may_fill(self, index: int) -> bool:
        """Fill `index` if the loop needs it, or if it ends at most `max_ahead_bytes` past what the
        loop needs: pages the writer gives back (with fast I/O, `fastio.page_release`) are then reused,
        not after the fill has touched the rest of the shard fresh."""
        needed_end = self._ends[self._needed] if self._needed >= 0 else 0
        return index <= self._needed or self._ends[index] - needed_end <= self._max_ahead

    def wait_filled(self, index: int) -> None:
        """Block until `tensors[index]` is filled (the task loop may write it then)."""
        with self._cond:
            if index > self._needed:
                self._needed = index
                self._cond.notify_all()
            self._cond.wait_for(lambda: self._filled > index or self._error is not None)
            if self._error is not None and self._filled <= index:
                raise RuntimeError(f"filling the model with NaN before loading failed: {self._error}") from self._error

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()


class _CheckBehind:
    """NaN-checks each completely written parameter on its own thread and marks it in the tracker
    (`max` releases the GIL too); a parameter with NaN is left unmarked and named by `unwritten`."""

    def __init__(self, tracker: FillTracker, checked: set[int]) -> None:
        self._tracker = tracker
        self._checked = checked
        self._queue: queue.SimpleQueue[tuple[int, torch.Tensor] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="sao-nan-check", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, key: int, tensor: torch.Tensor) -> None:
        self._queue.put((key, tensor))

    def _run(self) -> None:
        while (entry := self._queue.get()) is not None:
            key, tensor = entry
            if has_nan(tensor):
                continue  # reported by `unwritten` after the loop, with the parameter's name
            self._checked.add(key)
            self._tracker.mark(tensor)

    def close(self) -> None:
        """Check what is queued, then stop (`checked` is final afterwards)."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join()


class FillSchedule:
    """NaN-fill each parameter before the first task writing it (on a thread running ahead of the
    task loop, `_FillAhead`), and check it and hand it to the tracker after the last one (on a
    thread trailing it, `_CheckBehind`), so the writer can write it while the next ones convert.
    The task loop itself only waits for a parameter to be filled before its first task. Tensors no
    task writes are filled up front and checked at the end, with everything written after the task
    loop (tied embeddings)."""

    def __init__(self, state: dict[str, torch.Tensor], late: set[int], tracker: FillTracker | None) -> None:
        """`state`: name -> every tensor that must end up written (parameters and persistent
        buffers); `late`: addresses of those written after the task loop; `tracker`: told about
        each parameter once it is checked (None: everything is checked by `unwritten` at the end)."""
        self.state = state
        self.tracker = tracker
        self.remaining: dict[int, int] = {}
        self.fill_index: dict[int, int] = {}
        """parameter address -> its position in the fill-ahead order (order of first tasks)."""
        self.targets: list[torch.Tensor] = []
        self.checked: set[int] = set()
        self.late = late

    def plan(self, tasks: list[Any]) -> None:
        for task in tasks:
            if task.megatron_module is not None and task.param_weight is not None:
                key = task.param_weight.data_ptr()
                self.remaining[key] = self.remaining.get(key, 0) + 1
                if key not in self.fill_index:
                    self.fill_index[key] = len(self.targets)
                    self.targets.append(task.param_weight)
        with torch.no_grad():
            for tensor in self.state.values():
                if tensor.data_ptr() not in self.remaining:
                    tensor.fill_(float("nan"))

    def run(self, tasks: list[Any]) -> Iterator[Any]:
        fill = _FillAhead(self.targets, FILL_AHEAD_BYTES)
        check = _CheckBehind(self.tracker, self.checked) if self.tracker is not None else None
        fill.start()
        if check is not None:
            check.start()
        try:
            for task in tasks:
                target = task.param_weight if task.megatron_module is not None else None
                key = target.data_ptr() if target is not None else None
                if key is not None:
                    fill.wait_filled(self.fill_index[key])
                yield task  # the bridge converts and copies it before asking for the next one
                if key is None:
                    continue
                self.remaining[key] -= 1
                if self.remaining[key] == 0 and check is not None and key not in self.late:
                    check.put(key, target)
        finally:
            fill.stop()
            if check is not None:
                check.close()

    def unwritten(self) -> list[str]:
        return [name for name, tensor in self.state.items()
                if tensor.data_ptr() not in self.checked and has_nan(tensor)]
