"""HF tensors read past the page cache into pooled buffers: `hf_reader.PrefetchingSource`'s fast path.

A tensor is read as the whole blocks around it (O_DIRECT: `direct_io.pread_whole_blocks`) into a
page-aligned buffer the tensor views, so no page-cache page is allocated for bytes read once; the
buffers come from a pool (`read_buffers.ReadBuffers`) and serve later reads of their size once the
conversion dropped the tensor. On the CI VM both the page cache and fresh memory cost CPU that a
conversion there is short of (docs/conversion.md#fast-io). Where the filesystem refuses O_DIRECT, a
file is read through the page cache, into the pool's buffers all the same.
"""

from __future__ import annotations

import os
import threading

import torch

from megatron_sao.checkpointing.fastio.direct_io import open_direct, pread_whole_blocks
from megatron_sao.checkpointing.fastio.read_buffers import ReadBuffers
from megatron_sao.models.hf_files import HFCheckpoint, TensorInfo


class DirectTensorReads:
    def __init__(self, checkpoint: HFCheckpoint, pool_bytes: int) -> None:
        self.checkpoint = checkpoint
        self.buffers = ReadBuffers(pool_bytes)
        """Every tensor is read into one of these: a consumed tensor's buffer serves a later read."""
        self._direct_fds: dict[str, int | None] = {}
        self._refused_fds: list[int] = []
        self._lock = threading.Lock()

    def _direct_fd(self, file: str) -> int | None:
        with self._lock:
            if file not in self._direct_fds:
                self._direct_fds[file] = open_direct(self.checkpoint.path / file, os.O_RDONLY)
            return self._direct_fds[file]

    def read(self, info: TensorInfo) -> torch.Tensor | None:
        """The tensor's bytes (uint8) read past the page cache, or None where that cannot be done
        for it (the caller reads it through the page cache, into `buffers.tensor`)."""
        if info.nbytes == 0 or info.offset % info.torch_dtype.itemsize:
            return None  # (a dtype view of the buffer needs the tensor's offset aligned to its elements)
        fd = self._direct_fd(info.file)
        if fd is None:
            return None
        try:
            raw = pread_whole_blocks(fd, info.offset, info.nbytes, self.buffers.tensor)
        except ValueError:
            raise ValueError(f"{self.checkpoint.path / info.file}: truncated while reading {info.name!r} "
                             f"(the file changed since it was checked)") from None
        if raw is None:  # refused: this file is read through the page cache from now on
            with self._lock:
                self._direct_fds[info.file] = None
                self._refused_fds.append(fd)  # closed by `close`: another thread may be reading it
        return raw

    def direct_fd(self, file: str) -> int | None:
        """The O_DIRECT descriptor of `file` (None: refused, or not opened yet): for tests."""
        with self._lock:
            return self._direct_fds.get(file)

    def close(self) -> None:
        with self._lock:
            for fd in [*self._direct_fds.values(), *self._refused_fds]:
                if fd is not None:
                    os.close(fd)
            self._direct_fds.clear()
            self._refused_fds.clear()
