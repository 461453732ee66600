"""Read buffers that come back for the next read once the last tensor viewing them is gone.

hf-to-mcore reads every HF tensor into a buffer of its own, which megatron-bridge converts into a
parameter and drops. A new buffer is memory the process has never touched: the kernel zeroes each
of its pages on the first write (the read), and on the CI VM that costs 0.2-0.9 CPU-s per GB
against 0.04 for writing pages already touched (docs/conversion.md, Benchmark, "fresh memory per
rank"); a `perf` profile of EP2 hf-to-mcore put 8-11% of a rank's CPU samples there (glibc
recycles some buffers, not all). `ReadBuffers.tensor(n)` hands out a page-aligned buffer (a private
anonymous mapping) as a uint8 tensor, and takes the mapping back when the tensor and every view of
it are garbage (a `weakref.finalize` on the numpy array the tensor wraps: torch holds that array
for as long as the storage lives). The next read of the same size gets it, its pages already
faulted in. A checkpoint repeats a handful of tensor sizes layer after layer, so buffers are kept
per exact size.

Idle buffers are resident memory: at most `max_bytes` of buffers, handed out or idle, are kept
(`hf_reader`: two I/O buckets, the read-ahead's and the returns'); a buffer coming back past that
is dropped, oldest idle ones first, and a larger one is handed out but never kept.
"""

from __future__ import annotations

import mmap
import queue
import threading
import weakref
from collections import deque

import numpy as np
import torch

_PAGE = mmap.PAGESIZE


class ReadBuffers:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"read buffers need a budget > 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.reused = 0
        """Buffers handed out again instead of new ones (for tests and benchmarks)."""
        self._idle: deque[tuple[int, mmap.mmap]] = deque()
        """(size, buffer) of the buffers back and not handed out again, oldest first."""
        self._idle_bytes = 0
        self._out_bytes = 0
        """Bytes of kept-size buffers handed out and not yet taken back."""
        # a buffer's finalizer runs wherever its last view dies, possibly inside a garbage
        # collection this class set off while holding its lock: it only queues the buffer
        # (`SimpleQueue.put` is reentrant), and the pool takes it back on its next call
        self._returned: queue.SimpleQueue[tuple[int, mmap.mmap]] = queue.SimpleQueue()
        self._lock = threading.Lock()

    def tensor(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of `nbytes` at a page-aligned address; its contents are not cleared."""
        size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        with self._lock:
            self._take_back()
            buffer = self._take_idle(size)
            keep = buffer is not None or size <= self.max_bytes
            if keep:
                self._out_bytes += size
        if buffer is None:
            buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        array = np.frombuffer(buffer, dtype=np.uint8)
        if keep:
            weakref.finalize(array, self._returned.put, (size, buffer)).atexit = False
        return torch.from_numpy(array)[:nbytes]

    def idle_bytes(self) -> int:
        with self._lock:
            self._take_back()
            return self._idle_bytes

    def _take_idle(self, size: int) -> mmap.mmap | None:
        for i in range(len(self._idle) - 1, -1, -1):  # the newest of its size
            if self._idle[i][0] == size:
                buffer = self._idle[i][1]
                del self._idle[i]
                self._idle_bytes -= size
                self.reused += 1
                return buffer
        return None

    def _take_back(self) -> None:
        """Keep the buffers whose last view is gone while the budget allows (under the lock)."""
        while True:
            try:
                size, buffer = self._returned.get_nowait()
            except queue.Empty:
                return
            self._out_bytes -= size
            if self._out_bytes + size > self.max_bytes:
                continue  # no room even with nothing idle: dropped, unmapped with its last reference
            while self._out_bytes + self._idle_bytes + size > self.max_bytes:
                self._idle_bytes -= self._idle.popleft()[0]
            self._idle.append((size, buffer))
            self._idle_bytes += size
