"""How far a background load may run ahead of the consumer that gives its memory back.

mcore-to-hf loads the checkpoint on a thread while the export reads each parameter as it completes,
and gives a parameter's pages back to the OS once it is exported (`page_release`). Fresh pages
cost 1.5-3 CPU-s per GB on this project's VMs, pages given back moments ago ~0.5
(docs/conversion.md#direct-io): the load should fill the parameters with the pages the export has
just given back, not with new ones. Left alone the load runs ahead of the export and touches most
of the shard fresh before the first page comes back. `LoadWindow` holds a reader before it reads an
item while the loaded-but-not-given-back bytes would exceed its capacity.

It never deadlocks: whenever the consumer waits for a parameter to load (`consumer_waiting`), every
reader goes on regardless, so the load order and the export order need not agree, and `close`
(the consumer finished or failed) lets the load run to its end. Nor does it hold back a load that
alone exceeds the capacity: an item is admitted whenever nothing is outstanding.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class LoadWindow:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"load window must be > 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.held_back = 0
        """Times a reader waited (measured by tests and benchmarks)."""
        self._outstanding = 0
        self._waiting_consumers = 0
        self._closed = False
        self._cond = threading.Condition()

    def _may_admit(self, nbytes: int) -> bool:
        return (self._closed or self._waiting_consumers > 0 or self._outstanding == 0
                or self._outstanding + nbytes <= self.capacity)

    def admit(self, nbytes: int) -> None:
        """A reader is about to load `nbytes` into the consumer's memory: wait for room."""
        with self._cond:
            if not self._may_admit(nbytes):
                self.held_back += 1
                self._cond.wait_for(lambda: self._may_admit(nbytes))
            self._outstanding += nbytes

    def given_back(self, nbytes: int) -> None:
        """The consumer gave `nbytes` of loaded memory back."""
        with self._cond:
            self._outstanding = max(0, self._outstanding - nbytes)
            self._cond.notify_all()

    @contextmanager
    def consumer_waiting(self) -> Iterator[None]:
        """Around the consumer's wait for a parameter: readers are not held back meanwhile."""
        with self._cond:
            self._waiting_consumers += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._waiting_consumers -= 1

    def close(self) -> None:
        """The consumer is done (or failed): no reader is held back from now on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
