"""One front-to-back pass over a `.distcp` file that hashes every byte and copies the tensor items a
rank loads straight into their targets, reading past the page cache (O_DIRECT where the
filesystem takes it) into two reused buffers (the next block is read while one is used).

mcore-to-hf used to read each file it verifies twice: the manifest check hashed it through the
page cache on one thread while the load `preadv`ed its items from there into the parameters on
another. On the CI VM a page-cache page costs like any fresh memory (faulted in from the host,
docs/conversion.md#direct-io): the checksum thread's buffered read was a fifth of the conversion's
CPU, and the page cache took the pages the export had just given back (`page_release`), so the
parameters were faulted in fresh as well. Here each byte is read once, into memory that stays
resident, and the page cache does not grow with the checkpoint (measured: docs/conversion.md,
Benchmark, "one read per file").

The caller finds where each item's bytes lie first (`distcp_items.storage_range`, small reads near
each item's ends); this pass then reads the file in `chunk_bytes` blocks and, for each block, hashes
it and copies the part of every item it overlaps into that item's target.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from megatron_sao.checkpointing.digest import new_hasher
from megatron_sao.checkpointing.fastio.direct_io import ALIGN, BOUNCE_BYTES, REFUSED_ERRNOS, Bounce, open_direct

STREAM_CHUNK_BYTES = 2 * BOUNCE_BYTES


@dataclass(kw_only=True)
class StreamItem:
    """`nbytes` bytes at `start` in the file, copied into `target` (contiguous; `nbytes` of it)."""

    name: str
    start: int
    target: torch.Tensor
    done: Callable[[], None]
    """Called once, after the item's last byte is copied."""
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.target.is_contiguous(), "stream targets are contiguous (the caller copies into others)"
        self.nbytes = self.target.numel() * self.target.element_size()


@dataclass
class FileDigests:
    """The files (relative to the checkpoint) whose digests a load computes as it reads them, with
    each one's algorithm; `found` fills in as each file's pass completes."""

    wanted: dict[str, str]
    found: dict[str, str] = field(default_factory=dict)


def stream_file(path: str, items: list[StreamItem], algorithm: str,
                admit: Callable[[int], None] | None = None, chunk_bytes: int = STREAM_CHUNK_BYTES) -> str:
    """Read all of `path` once: fill every item and return the file's digest. `admit(nbytes)` is
    called before an item's first byte is copied (`load_window`). Raises OSError naming the first
    item the file ends inside of (a truncated file)."""
    assert chunk_bytes % ALIGN == 0
    pending = sorted(items, key=lambda item: item.start)
    hasher = new_hasher(algorithm)
    reader = _Reader(path)
    size = os.fstat(reader.fd).st_size
    # no bigger than the file: most of a checkpoint's files (metadata, tokenizer) are a few KB, and
    # a rank streams them all when they fall in its checksum share
    chunk_bytes = max(ALIGN, min(chunk_bytes, -(-size // ALIGN) * ALIGN))
    bounces = [Bounce(chunk_bytes), Bounce(chunk_bytes)]  # one is read into while the other is used
    blocks = [torch.frombuffer(bounce.view, dtype=torch.uint8) for bounce in bounces]

    def read(which: int, position: int) -> int:
        wanted = min(chunk_bytes, size - position)
        return reader.read(bounces[which].view[:-(-wanted // ALIGN) * ALIGN], position, wanted)

    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sao-distcp-read") as prefetch:
            active: list[tuple[StreamItem, torch.Tensor]] = []  # (item, its target's bytes)
            next_item, position, which = 0, 0, 0
            ahead = prefetch.submit(read, which, position) if size else None
            while ahead is not None:
                n = ahead.result()
                if n == 0:
                    break  # the file shrank since fstat: the items left say where
                end = position + n
                ahead = prefetch.submit(read, 1 - which, end) if end < size else None
                block = blocks[which]
                hasher.update(bounces[which].view[:n])
                while next_item < len(pending) and pending[next_item].start < end:
                    item = pending[next_item]
                    if admit is not None:
                        admit(item.nbytes)
                    active.append((item, item.target.reshape(-1).view(torch.uint8)))
                    next_item += 1
                still = []
                for item, target_bytes in active:
                    first, last = max(item.start, position), min(item.start + item.nbytes, end)
                    if first < last:
                        target_bytes[first - item.start:last - item.start].copy_(
                            block[first - position:last - position])
                    if item.start + item.nbytes <= end:
                        item.done()
                    else:
                        still.append((item, target_bytes))
                active, position, which = still, end, 1 - which
        unfinished = [item for item, _ in active] + pending[next_item:]
        if unfinished:
            raise OSError(f"{path}: ends inside tensor item {unfinished[0].name!r}: truncated file")
        return hasher.hexdigest()
    finally:
        del blocks
        reader.close()
        for bounce in bounces:
            bounce.close()


class _Reader:
    """Sequential reads at aligned offsets into an aligned buffer: O_DIRECT where the filesystem
    takes it, through the page cache otherwise (or from the first read it refuses on)."""

    def __init__(self, path: str) -> None:
        self.path = path
        direct = open_direct(path, os.O_RDONLY)
        self.direct = direct is not None
        self.fd = direct if direct is not None else os.open(path, os.O_RDONLY)

    def read(self, view: memoryview, position: int, wanted: int) -> int:
        """Read `wanted` bytes (fewer only where the file ends first) into `view` (`wanted` rounded
        up to the block) from `position` (aligned); returns the bytes read."""
        done = 0
        while done < wanted:
            if self.direct and done % ALIGN:
                self._buffered()  # a short read mid-file: the next direct one would be unaligned
            try:
                n = os.preadv(self.fd, [view[done:]], position + done)
            except OSError as error:
                if not self.direct or error.errno not in REFUSED_ERRNOS:
                    raise
                self._buffered()
                continue
            if n == 0:
                break
            done += n
        return min(done, wanted)

    def _buffered(self) -> None:
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.direct = False

    def close(self) -> None:
        os.close(self.fd)
