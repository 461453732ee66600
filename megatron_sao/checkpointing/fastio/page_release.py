"""Give a tensor's memory back to the OS while the tensor lives on (its values become zeros).

hf-to-mcore builds the whole Megatron shard, fills it and writes it: every byte of it is memory the
process has never touched, and on a VM that hands guest memory back to the host (virtio-balloon
free-page reporting, as on this project's CI machines) touching fresh memory costs 1.5-3 CPU-s
per GB (`docs/conversion.md#direct-io`), the largest single cost of the conversion. Once a
parameter is on disk the conversion never reads it again, so its pages can go back at once with
`MADV_DONTNEED`: the kernel hands the same pages to the next parameter's first touch (it reuses
freed pages first), before the host takes them back. The tensor keeps its address and size (views,
address-keyed bookkeeping and the allocator's own metadata stay valid); only whole pages inside its
bytes are released, so no neighbour's bytes are touched. Reads of a released tensor return zeros.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys

import torch

_MADV_DONTNEED = 4
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def releasable_range(address: int, nbytes: int) -> tuple[int, int]:
    """The whole pages inside [address, address + nbytes): (start, length), length 0 if none."""
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return start, max(0, end - start)


def release_pages(address: int, nbytes: int) -> int:
    """Release the whole pages inside the byte range (memory the caller owns and will not read
    again, or reads as zeros); returns the bytes released (0 off Linux, or where the mapping
    refuses: a memory saving, never a failure)."""
    start, length = releasable_range(address, nbytes)
    if _libc is None or length == 0:
        return 0
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED) != 0:
        error = ctypes.get_errno()
        if error in (errno.EINVAL, errno.EAGAIN):
            return 0  # a mapping that refuses it (locked, huge-page backed) keeps its pages: only the saving is lost
        raise OSError(error, f"madvise(MADV_DONTNEED) of {length} bytes at {start:#x}: {os.strerror(error)}")
    return length


def release_tensor(tensor: torch.Tensor) -> int:
    """`release_pages` over a CPU tensor's own bytes (a contiguous range)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous(), "only a contiguous CPU tensor's bytes are a range"
    return release_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size())
