"""Checkpoint reads and writes that bypass the page cache (O_DIRECT) where the filesystem takes them.

Measured on the 2-core Firecracker VM CI runs on (docs/conversion.md#direct-io): `dd` of 1 GB
with fsync takes 3.3 s wall and 3.0 CPU-s in the kernel through the page cache, 0.7 s and 0.15
CPU-s with O_DIRECT. Conversions there are CPU-bound, and the buffered write was half of
hf-to-mcore's CPU. O_DIRECT needs the file offset, the length and the memory address aligned to
the device's block, so bytes go through a page-aligned bounce buffer (one memcpy, reused, so no
fresh pages to fault in):
- `DirectHashingFile`: a new file written front to back (torch_dist's `.distcp` files), hashed as
  written, like `hashing_file.HashingFile`; the last partial block is padded, then truncated away.
- `PositionalWriter`: writes at any offset of an existing file (safetensors tensors at their
  planned places, several processes writing one file): the whole aligned blocks inside a range go
  direct, its unaligned head and tail through the page cache, on a second descriptor. Blocks are
  never shared between the two paths (alignment is at least the page size), so the kernel keeps
  them coherent; the final fsync covers both.
- `pread_whole_blocks`: bytes at any offset, read as the whole blocks around them into a new
  aligned buffer (HF tensors in `hf_reader`): no page-cache pages, which on that VM cost like any
  fresh memory (each is faulted in from the host).
- `Bounce`: the aligned buffer itself, also used by `distcp_stream` (mcore-to-hf reads each
  `.distcp` file of its checksum share once, front to back, hashing it and filling its items).

Where the filesystem refuses O_DIRECT (tmpfs, some FUSE and network filesystems: EINVAL at open or
at the first read or write), I/O goes through the page cache as before. All of it runs only behind
the fast-I/O switch (`--fastio`, docs/conversion.md#fast-io).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_sao.checkpointing.digest import DEFAULT as DEFAULT_DIGEST
from megatron_sao.checkpointing.digest import new_hasher
from megatron_sao.checkpointing.fastio.writeback import WritebackHashingFile, start_writeback

ALIGN = max(4096, mmap.PAGESIZE)
"""Block size direct I/O is aligned to: every common logical block size divides it, and no page
holds both directly and buffered written bytes."""
BOUNCE_BYTES = 8 * 2**20
REFUSED_ERRNOS = (errno.EINVAL, errno.EOPNOTSUPP)


def open_direct(path: str | Path, flags: int, mode: int = 0o644) -> int | None:
    """`os.open` with O_DIRECT; None where the OS has no O_DIRECT or the filesystem refuses it."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, flags | os.O_DIRECT, mode)
    except OSError as error:
        if error.errno in REFUSED_ERRNOS:
            return None
        raise


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _align_down(n: int) -> int:
    return n // ALIGN * ALIGN


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _pwrite_direct(fd: int, view: memoryview, offset: int) -> bool:
    """Write aligned `view` at aligned `offset`; False (nothing lost: the caller writes it buffered)
    where the filesystem refuses O_DIRECT at write time."""
    try:
        _pwrite_all(fd, view, offset)
    except OSError as error:
        if error.errno in REFUSED_ERRNOS:
            return False
        raise
    return True


class Bounce:
    """A page-aligned buffer (`view`) for direct I/O, allocated once and reused."""

    def __init__(self, nbytes: int | None = None) -> None:
        nbytes = BOUNCE_BYTES if nbytes is None else nbytes
        assert nbytes % ALIGN == 0
        # page-aligned; private: a fresh private page faults in at about half the kernel time of a
        # shared one (measured: O_DIRECT reads into new 16 MB buffers, 0.5 vs 1.1 CPU-s per GB)
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)

    def __len__(self) -> int:
        return len(self.view)

    def close(self) -> None:
        self.view.release()
        self._map.close()


class DirectHashingFile:
    """`hashing_file.HashingFile` with O_DIRECT writes through a bounce buffer; use `hashing_file`,
    which returns a `WritebackHashingFile` where the filesystem refuses O_DIRECT."""

    def __init__(self, fd: int, digest: str = DEFAULT_DIGEST) -> None:
        self._fd = fd
        self._digest = new_hasher(digest)
        self._bounce = Bounce()
        self._filled = 0
        self._drained = 0
        self._direct = True
        self._queued = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._digest.update(view)
        done, n = 0, len(view)
        while done < n:
            take = min(n - done, len(self._bounce) - self._filled)
            self._bounce.view[self._filled:self._filled + take] = view[done:done + take]
            self._filled += take
            done += take
            if self._filled == len(self._bounce):
                self._drain(self._filled)
        return n

    def _drain(self, nbytes: int) -> None:
        """Write the first `nbytes` (aligned) of the bounce buffer at the end of the file."""
        chunk = self._bounce.view[:nbytes]
        if self._direct and not _pwrite_direct(self._fd, chunk, self._drained):
            self._direct = False  # this filesystem takes O_DIRECT opens but not writes
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        if not self._direct:
            _pwrite_all(self._fd, chunk, self._drained)
        self._drained += nbytes
        self._filled = 0

    def tell(self) -> int:
        return self._drained + self._filled

    def flush(self) -> None:
        """Nothing to do: bytes not yet a whole bounce buffer are written by `finish`."""

    def fileno(self) -> int:
        return self._fd

    def kick(self) -> None:
        """Start write-back of what reached the page cache (only after a fallback to it)."""
        if not self._direct:
            start_writeback(self._fd, self._queued, self._drained - self._queued)
            self._queued = self._drained

    def finish(self) -> tuple[int, str]:
        """Write the rest (padded to a block, then truncated to the real size), fsync and close;
        returns (bytes, digest hex)."""
        size = self.tell()
        tail = self._filled
        if tail:
            padded = _align_up(tail)
            self._bounce.view[tail:padded] = bytes(padded - tail)
            self._drain(padded)
            os.ftruncate(self._fd, size)
        os.fsync(self._fd)
        self.close()
        return size, self._digest.hexdigest()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._bounce.close()


def hashing_file(path: str | Path, digest: str = DEFAULT_DIGEST) -> Any:
    """A new file at `path` that hashes what is written to it: `DirectHashingFile` where the
    filesystem takes O_DIRECT, else `writeback.WritebackHashingFile` (through the page cache, its
    write-back started item by item)."""
    fd = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    return WritebackHashingFile(path, digest) if fd is None else DirectHashingFile(fd, digest)


class PositionalWriter:
    """Writes at any offset of the existing file open as `fd` (read-write, through the page cache):
    aligned whole blocks with O_DIRECT through a bounce buffer, head and tail through `fd`. Safe to
    call from several threads (one bounce buffer, taken in turn)."""

    def __init__(self, path: str | Path, fd: int) -> None:
        self.fd = fd
        self._direct_fd = open_direct(path, os.O_WRONLY)
        self._bounce: Bounce | None = None
        self._lock = threading.Lock()

    def write(self, data: memoryview, offset: int) -> None:
        """Write all of `data` at `offset`, then start write-back of what went through the page cache."""
        end = offset + len(data)
        start, stop = _align_up(offset), _align_down(end)
        if self._direct_fd is None or stop - start < ALIGN:
            _pwrite_all(self.fd, data, offset)
            start_writeback(self.fd, offset, len(data))
            return
        _pwrite_all(self.fd, data[:start - offset], offset)
        _pwrite_all(self.fd, data[stop - offset:], stop)
        with self._lock:
            if self._bounce is None:
                self._bounce = Bounce()
            position = start
            while position < stop and self._direct_fd is not None:
                n = min(len(self._bounce), stop - position)
                self._bounce.view[:n] = data[position - offset:position - offset + n]
                if not _pwrite_direct(self._direct_fd, self._bounce.view[:n], position):
                    os.close(self._direct_fd)
                    self._direct_fd = None
                    break
                position += n
        if position < stop:
            _pwrite_all(self.fd, data[position - offset:stop - offset], position)
        start_writeback(self.fd, offset, len(data))

    def close(self) -> None:
        """Close the direct descriptor (`fd` is the caller's)."""
        with self._lock:
            if self._direct_fd is not None:
                os.close(self._direct_fd)
                self._direct_fd = None
            if self._bounce is not None:
                self._bounce.close()
                self._bounce = None


def _new_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def pread_whole_blocks(fd: int, offset: int, nbytes: int,
                       allocate: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor | None:
    """Bytes [offset, offset + nbytes) of the O_DIRECT descriptor `fd` as a uint8 tensor (a view
    into a buffer holding the whole blocks around them: `allocate(n)`'s uint8 tensor, e.g.
    `fastio.read_buffers.ReadBuffers.tensor`, or a new one); None where the filesystem refuses the read
    (EINVAL) or returns a short one before the end of the file (the caller reads through the page
    cache instead). A file shorter than the range raises ValueError."""
    start, stop = _align_down(offset), _align_up(offset + nbytes)
    raw = (allocate or _new_bytes)(stop - start + ALIGN)
    pad = -raw.data_ptr() % ALIGN
    window = raw[pad:pad + stop - start]
    view = memoryview(window.numpy())
    done, wanted = 0, offset + nbytes - start
    while done < wanted:
        if done % ALIGN:
            return None  # a short read mid-file: the next one would be unaligned
        try:
            n = os.preadv(fd, [view[done:]], start + done)
        except OSError as error:
            if error.errno in REFUSED_ERRNOS:
                return None
            raise
        if n == 0:
            raise ValueError(f"file ends at {start + done} bytes, inside the range [{offset}, {offset + nbytes})")
        done += n
    return window[offset - start:offset - start + nbytes]

