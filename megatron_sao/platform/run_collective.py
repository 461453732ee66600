"""Run a collective conversion function in this process, under a launcher, or on local workers.

- under torchrun (RANK / WORLD_SIZE set) every process calls the function itself;
- under srun without torchrun, SLURM's variables are adopted (`platform.slurm.adopt_slurm_env`:
  MASTER_ADDR and MASTER_PORT must be exported; docs/conversion.md#multi-process gives the command);
- otherwise `nproc` > 1 spawns that many local processes (`platform.run_distributed`), and 1 runs
  the function here, as a world of one.
The result is rank 0's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def under_launcher() -> bool:
    """Whether this process is a rank a launcher started: torchrun's variables, or several srun
    tasks (adopted by `platform.slurm.adopt_slurm_env`, the same rule as the trainer's rank steps)."""
    from megatron_sao.platform.slurm import adopt_slurm_env

    adopt_slurm_env()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


_USER_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "NotImplementedError": NotImplementedError}


def _call_keeping_user_errors(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """Worker side: a user error travels back as (type name, message), not as a traceback."""
    try:
        return "ok", fn(*args)
    except tuple(_USER_ERRORS.values()) as e:
        return type(e).__name__ if type(e).__name__ in _USER_ERRORS else "ValueError", str(e)


def run_collective(fn: Callable[..., Any], nproc: int, *args: Any) -> tuple[int, Any]:
    """(this process's rank, rank 0's result of `fn(*args)`) — the rank is 0 for spawned workers."""
    from megatron_sao.platform import init_distributed, run_distributed

    if under_launcher() or nproc <= 1:
        rank, _ = init_distributed()
        return rank, fn(*args)
    status, payload = run_distributed(_call_keeping_user_errors, nproc, fn, *args)[0]
    if status != "ok":
        raise _USER_ERRORS[status](payload)
    return 0, payload
