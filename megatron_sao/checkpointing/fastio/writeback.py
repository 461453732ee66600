"""Start the disk's write-back of each written range at once (`sync_file_range`), instead of at
the final fsync.

Written bytes first land in the page cache; left alone, the kernel flushes them only under memory
pressure or at the final fsync, so the disk idles while the conversion computes and then the whole
write is paid for at the end. `start_writeback` queues a range for writing without waiting
(`SYNC_FILE_RANGE_WRITE`; Linux, a no-op elsewhere); `WritebackHashingFile` calls it on each item
once it is complete. Part of the fast-I/O path (docs/conversion.md#fast-io): measured on this
project's 2-core CI VM, not on a GPU node.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

from megatron_sao.checkpointing.hashing_file import HashingFile

_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Any:
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Queue `nbytes` at `offset` of `fd` for writing to disk, without waiting for it."""
    if _sync_file_range is not None and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # best effort: fsync still follows


class WritebackHashingFile(HashingFile):
    """`HashingFile` whose `kick` starts the write-back of what was written since the last kick."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queued = 0

    def kick(self) -> None:
        self.flush()
        end = self.tell()
        start_writeback(self.fileno(), self._queued, end - self._queued)
        self._queued = end
