"""Keep freed I/O buffers in the process instead of handing their pages back to the kernel.

glibc serves an allocation above its mmap threshold (128 KB, raised as it sees frees, to 32 MB at
most) from a fresh mapping and unmaps it on free. A conversion reads every HF tensor into a new
buffer of a few MB (`hf_reader`), so every byte it reads first faults in a fresh zeroed page: on the
2-core CI VM, where faulting memory in costs 0.5-0.9 CPU-s per GB of kernel time, keeping freed
buffers cut hf-to-mcore's CPU by ~1 CPU-s per GB (docs/conversion.md#direct-writes).
`reuse_freed_buffers` sets glibc's mmap threshold to 64 MB and its trim threshold to 1 GB
(`mallopt`), so buffers come from the heap and a freed one is reused by the next read. What is
live at once is still bounded by the I/O bucket; what the heap keeps after frees is reused, not
added to. Elsewhere than glibc it does nothing.

It changes the whole process for good, and with it where later tensors land in memory, which
moves the last bits of some CPU kernels' float sums (MKL does not promise the same bits at another
alignment): so the library never calls it; the process that owns a conversion does (`sao convert`
and `tools/bench_convert.py` wrap each rank's conversion in `with_reused_buffers`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from typing import Any

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 2**20
TRIM_THRESHOLD_BYTES = 2**30


def reuse_freed_buffers() -> bool:
    """Make freed buffers below 64 MB stay in the process for reuse; False where not glibc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                    TRIM_THRESHOLD_BYTES))


def with_reused_buffers(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a process whose freed buffers are reused (for a rank that only converts)."""
    reuse_freed_buffers()
    return fn(*args)
