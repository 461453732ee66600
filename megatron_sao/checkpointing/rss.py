"""Resident memory of one conversion on each rank: what the memory budget is checked against.

`ru_maxrss` is the process's lifetime peak (imports, earlier work); Linux lets a process reset its
high-water mark (`/proc/self/clear_refs` <- 5), so `measured` resets it, runs the conversion and
reads VmHWM: the peak during the conversion alone, next to the resident memory it started from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")


def _status_kb(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise ValueError(f"{_STATUS}: no {field} line")


def reset_peak() -> bool:
    """Reset this process's peak RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measured(fn: Callable[..., dict], *args: Any) -> dict:
    """`fn(*args)`'s result plus `rss_start` and `rss_peak` (bytes) of this rank during the call."""
    import gc

    gc.collect()
    reset = reset_peak()
    start = _status_kb("VmRSS") * 1024
    result = dict(fn(*args))
    result.update(rss_start=start, rss_peak=_status_kb("VmHWM") * 1024, rss_peak_reset=reset)
    return result
