"""The I/O bucket: how many bytes a conversion rank holds in flight besides its shard.

hf-to-mcore reads HF tensors ahead of the conversion (`hf_reader`) and stages tensors for the
torch_dist writer (`dist_writer`) within it, so a rank's memory is about its shard plus the bucket
(docs/conversion.md#memory-and-streaming; `--io-bucket-mb`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

DEFAULT_IO_BUCKET_BYTES = 256 * 2**20
"""Per rank: bytes of HF tensors read ahead (`hf_reader`) and of tensors staged for the torch_dist
writer (`dist_writer`) at most; a conversion's memory is about its shard plus this."""


class ByteBudget:
    """At most `capacity` bytes held at a time; a larger request is served alone."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"I/O bucket must be > 0 bytes, got {capacity}")
        self.capacity = capacity
        self.peak = 0
        self._used = 0
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        n = min(nbytes, self.capacity)
        with self._cond:
            self._cond.wait_for(lambda: self._used + n <= self.capacity)
            self._used += n
            self.peak = max(self.peak, self._used)
        try:
            yield
        finally:
            with self._cond:
                self._used -= n
                self._cond.notify_all()
