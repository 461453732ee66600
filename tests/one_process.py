"""Several short spawned jobs in one process (default-suite time, issue 28): on the 2-core box a
spawned rank's start-up and imports (torch, Megatron, megatron-bridge) cost ~5-10 s, as much as a
tiny job itself, so tests that each spawned the same world for one job share one spawn."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def jobs_in_one_process(jobs: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]) -> dict[str, Any]:
    """Run jobs one after another in this (spawned) process: {name: fn(*args)}. Each job builds its
    own model parallel state and models (`init_model_parallel` re-seeds), as in a process of its
    own; what is shared is the process start-up and the imports."""
    return {name: fn(*args) for name, (fn, args) in jobs.items()}
