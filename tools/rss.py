"""Resident memory of one conversion on each rank: what the memory budget is checked against.

A measurement harness, not part of the library: `tools/bench_convert.py` and the memory-budget
test (tests/checkpointing/test_memory_budget.py) use it. Import it as `tools.rss` from the
repository root (the tests), or as `rss` from a script in tools/ (its directory is on sys.path).

`ru_maxrss` is the process's lifetime peak (imports, earlier work); Linux lets a process reset its
high-water mark (`/proc/self/clear_refs` <- 5), so `measured` resets it, runs the conversion and
reads VmHWM: the peak during the conversion alone, next to the resident memory it started from.

A fresh process also grows by ~200 MB the first time it imports and sets up the conversion stack
(Megatron-Core, megatron-bridge, transformers and the family's modeling code), whatever the model
size. `measured(..., warm_dir=HF config dir)` pays that first (`warm_up`), so the growth it reports
is what the conversion itself holds: the budget is about what grows with the model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")


def _status_kb(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise ValueError(f"{_STATUS}: no {field} line")


def resident_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def release_free_memory() -> None:
    """Hand memory the allocator keeps after frees back to the kernel (glibc `malloc_trim`), so a
    measurement does not start with room an earlier step freed and the next one could reuse."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return


def reset_peak() -> bool:
    """Reset this process's peak RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def warm_up(config_dir: Path) -> None:
    """Import what a conversion of the checkpoint whose config.json is in `config_dir` imports."""
    import megatron.core.dist_checkpointing  # noqa: F401

    from megatron_sao.checkpointing import dist_reader, dist_writer, hf_reader  # noqa: F401
    from megatron_sao.models import build_model  # noqa: F401
    from megatron_sao.models.bridge_compat import import_auto_bridge
    from megatron_sao.models.hf_files import expected_hf_tensors

    import_auto_bridge()
    expected_hf_tensors(config_dir)  # the family's transformers modeling code


def measured(fn: Callable[..., dict], *args: Any, warm_dir: Path | None = None) -> dict:
    """`fn(*args)`'s result plus `rss_start` and `rss_peak` (bytes) of this rank during the call
    (after `warm_up(warm_dir)` when given), and `cpu_seconds`: CPU time of all its threads (on a
    shared host, wall time says little; CPU time per byte says what the conversion costs), of it
    `kernel_cpu_seconds`, and `faulted_bytes`: memory first touched during the call (minor page
    faults x page size; every such page is zeroed by the kernel, the largest kernel cost measured
    on the CI VM, docs/conversion.md#fast-io)."""
    import gc
    import resource

    if warm_dir is not None:
        warm_up(warm_dir)
    gc.collect()
    release_free_memory()
    reset = reset_peak()
    start = resident_bytes()
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    result = dict(fn(*args))
    end = resource.getrusage(resource.RUSAGE_SELF)
    result.update(rss_start=start, rss_peak=_status_kb("VmHWM") * 1024, rss_peak_reset=reset,
                  # user + kernel deltas summed as deltas: with no user time the total equals the
                  # kernel share exactly (a sum of the four totals can round below it)
                  cpu_seconds=(end.ru_utime - cpu.ru_utime) + (end.ru_stime - cpu.ru_stime),
                  kernel_cpu_seconds=end.ru_stime - cpu.ru_stime,
                  faulted_bytes=(end.ru_minflt - cpu.ru_minflt) * resource.getpagesize())
    return result
