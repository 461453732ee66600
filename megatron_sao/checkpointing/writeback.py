"""Output files that hash what they write and start the disk's write-back as they go.

A conversion writes as many bytes as it reads. Written bytes first land in the page cache; left
alone, the kernel flushes them only under memory pressure or at the final fsync, so the disk idles
while the conversion computes and then the whole write is paid for at the end. `HashingFile`
calls `sync_file_range(SYNC_FILE_RANGE_WRITE)` on each range once it is complete (Linux; a no-op
elsewhere), which queues it for writing without waiting: the disk writes while the next bytes are
produced. It also feeds every byte to the manifest's digest, so its checksums cost no second read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import Any

from megatron_sao.checkpointing.digest import DEFAULT as DEFAULT_DIGEST
from megatron_sao.checkpointing.digest import new_hasher

_SYNC_FILE_RANGE_WRITE = 2
DEFAULT_IO_BUCKET_BYTES = 256 * 2**20
"""Per rank: bytes of HF tensors read ahead (`hf_reader`) and of tensors staged for the torch_dist
writer (`dist_writer`) at most; a conversion's memory is about its shard plus this."""


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


class HashingFile:
    """A new binary file, written sequentially: the digest of its bytes, write-back started per `kick`."""

    def __init__(self, path: str | Path, digest: str = DEFAULT_DIGEST) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 - closed by finish / close
        self._digest = new_hasher(digest)
        self._queued = 0

    def write(self, data: Any) -> int:
        self._digest.update(data)
        return self._file.write(data)

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def kick(self) -> None:
        """Start writing what was written since the last kick."""
        self._file.flush()
        end = self._file.tell()
        start_writeback(self._file.fileno(), self._queued, end - self._queued)
        self._queued = end

    def finish(self) -> tuple[int, str]:
        """Flush, fsync and close; returns (bytes, digest hex)."""
        self._file.flush()
        size = self._file.tell()
        os.fsync(self._file.fileno())
        self._file.close()
        return size, self._digest.hexdigest()

    def close(self) -> None:
        self._file.close()
