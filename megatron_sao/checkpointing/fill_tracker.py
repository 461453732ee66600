"""Which parameters a conversion has filled so far: lets the torch_dist writer write a tensor as soon
as it is filled (hf-to-mcore: the save overlapped with the load), or the export read it as soon as
it is loaded (mcore-to-hf), instead of after the whole model.

A writer item is a parameter or a view of one (gated fc1 halves, expert slices), so an item is ready
when the parameter whose memory holds its first byte is. Tracked by address range, not by tensor
identity: views, `.data` and wrappers all resolve to the same parameter. An item outside every
tracked range (a buffer the producer fills some other way) is ready once the producer calls
`finish`. A failing producer calls `fail`: every waiting writer raises instead of waiting forever.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Iterable

import torch


class FillTracker:
    def __init__(self, fill_order: Iterable[torch.Tensor]) -> None:
        """`fill_order`: the tensors the producer fills, in about the order it fills them (writers
        write in this order, so they wait as little as possible; any order is correct)."""
        spans = []
        for position, tensor in enumerate(fill_order):
            if tensor.numel() > 0:
                start = tensor.data_ptr()
                spans.append((start, start + tensor.numel() * tensor.element_size(), position))
        spans.sort()
        for (_, end, _), (start, _, _) in itertools.pairwise(spans):
            assert end <= start, "tracked tensors overlap in memory"
        self._starts = [s for s, _, _ in spans]
        self._spans = spans
        self._ready: set[int] = set()
        self._finished = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def span(self, tensor: torch.Tensor) -> int | None:
        """Which tracked tensor holds `tensor`'s first byte (an index), or None."""
        address = tensor.data_ptr()
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._spans[i][1]:
            return i
        return None

    def extent(self, index: int) -> tuple[int, int]:
        """(address, bytes) of tracked tensor `index` (as returned by `span`)."""
        start, end, _ = self._spans[index]
        return start, end - start

    def position(self, tensor: torch.Tensor) -> int:
        """Where `tensor` comes in the fill order (untracked tensors last)."""
        i = self.span(tensor) if tensor.numel() > 0 else None
        return len(self._spans) if i is None else self._spans[i][2]

    def mark(self, tensor: torch.Tensor) -> None:
        """`tensor` (a tracked tensor) is completely filled: its items may be written."""
        i = self.span(tensor)
        assert i is not None, "marked a tensor the tracker does not track"
        with self._cond:
            self._ready.add(i)
            self._cond.notify_all()

    def finish(self) -> None:
        """The producer is done: everything is ready."""
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def wait_finished(self) -> None:
        """Block until the producer called `finish` (or `fail`: RuntimeError)."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self._finished)
            if self._error is not None:
                raise RuntimeError(f"the conversion filling this checkpoint failed: {self._error}") from self._error

    def wait(self, tensor: torch.Tensor) -> None:
        """Block until `tensor` is filled; RuntimeError if the producer failed first."""
        i = self.span(tensor) if tensor.numel() > 0 else None
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self._finished
                                or (i is not None and i in self._ready))
            if self._error is not None:
                raise RuntimeError(f"the conversion filling this checkpoint failed: {self._error}") from self._error
