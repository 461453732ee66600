"""Run a function on N local processes with torch.distributed initialised (gloo on CPU).

What torchrun does for scripts, as a function call: used by multi-rank tests, by tools that
convert checkpoints with several processes, and by the CPU demo. Results come back per rank;
an exception on any rank is re-raised here with that rank's traceback.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue as queue_module
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from megatron_sao.platform.distributed import free_port
from megatron_sao.utils import lifetime


class RankFailed(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


class RankUserError(RankFailed, ValueError):
    """A rank raised a user error (`ValueError` / `NotImplementedError`: bad input, found where only
    a rank could find it). It stays one: `str()` is that error's own message, once, however many
    ranks raised it, so the command exits 2 with it as its last line (docs/exit-codes.md);
    `tracebacks` keeps what the failing ranks reported, for the log."""

    def __init__(self, message: str, tracebacks: str) -> None:
        super().__init__(message)
        self.tracebacks = tracebacks


def user_error_of(error: BaseException | None) -> str | None:
    """The message of `error` when it is a user error (as `utils.console.run_command` counts them)."""
    return str(error) if isinstance(error, ValueError | NotImplementedError) else None


def rank_failure(failures: list[tuple[int, str, str | None]]) -> RankFailed:
    """The exception for failed ranks, each (rank, traceback or reason, user error message or None):
    the lowest rank's user error as `RankUserError` when any rank had one (the others most likely
    failed because of it: a peer gone from a collective), else `RankFailed` with every traceback."""
    tracebacks = "\n".join(f"rank {rank} failed:\n{text}" for rank, text, _ in failures)
    user = sorted((rank, message) for rank, _, message in failures if message is not None)
    if user:
        return RankUserError(user[0][1], tracebacks)
    return RankFailed(tracebacks)


def configure_rank_process(rank: int, threads: int) -> None:
    """Logging, warnings and torch threads of a fresh rank process (spawned here or a Ray actor):
    rank 0 speaks, the others only warn; the libraries' per-bucket / per-plugin chatter is kept
    out of the job's output."""
    import logging
    import warnings

    import torch

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, force=True,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    for noisy in ("megatron.core", "megatron.bridge", "modelopt"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(threads)


PORT_ATTEMPTS = 3
"""Launches of one `run_distributed` call: the rendezvous port is picked free, but another process
can take it before rank 0 binds it (busy hosts, parallel test runs); such a launch is retried on a
new port, before `fn` has run anywhere."""


def _port_taken(error: BaseException) -> bool:
    return "EADDRINUSE" in str(error) or "address already in use" in str(error).lower()


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue) -> None:
    # Ends with the driver, and takes what it starts along (utils/lifetime.py). The driver's thread
    # that started this process waits in `_launch` for it, but a pidfd watch is exact regardless.
    lifetime.lead_process_group()
    lifetime.die_with_parent(multiprocessing.parent_process().pid, grace_s=0)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    configure_rank_process(rank, threads=max(1, (os.cpu_count() or 1) // world_size))
    from megatron_sao.platform.distributed import destroy_distributed, init_distributed

    try:
        try:
            init_distributed()
        except Exception as error:
            queue.put((rank, "port_taken" if _port_taken(error) else "failed", traceback.format_exc(), None))
            return
        result = fn(*args)
        # Plain pickle (by value) rather than the queue's torch reducer, which shares tensor
        # storage through file descriptors the parent must fetch from this process while it is
        # still alive: a race with this process exiting right after.
        queue.put((rank, "ok", pickle.dumps(result), None))
    except BaseException as error:
        queue.put((rank, "failed", traceback.format_exc(), user_error_of(error)))
    finally:
        with contextlib.suppress(Exception):  # teardown after a failure must not mask it
            destroy_distributed()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """Call `fn(*args)` on `world_size` fresh processes; return the per-rank results in rank order.

    `fn` must be importable (module level) and its arguments and result picklable.
    """
    for attempt in range(PORT_ATTEMPTS):
        results, failures, port_taken = _launch(fn, world_size, args, timeout_s)
        if not port_taken or attempt == PORT_ATTEMPTS - 1:
            break
    if failures:
        raise rank_failure(failures)
    return [results[r] for r in range(world_size)]


def _launch(fn: Callable[..., Any], world_size: int, args: tuple,
            timeout_s: float) -> tuple[dict[int, Any], list[tuple[int, str, str | None]], bool]:
    """One launch on a fresh port: (results by rank, failures, whether the port was taken)."""
    ctx = mp.get_context("spawn")
    lifetime.run_id()  # the ranks inherit the run's tag
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[tuple[int, str, str | None]] = []  # (rank, traceback or reason, user error message)
    port_taken = False
    finished = False
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not failures:
            try:
                message = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    failures.append((dead[0], f"rank(s) {dead} died with exit code(s) "
                                              f"{[procs[r].exitcode for r in dead]} before reporting", None))
                elif time.monotonic() > deadline:
                    failures.append((-1, f"timed out after {timeout_s:.0f} s waiting for ranks "
                                         f"{sorted(set(range(world_size)) - set(results))}", None))
                continue
            rank, status, payload, user_error = message
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                port_taken = status == "port_taken"
                failures.append((rank, payload, user_error))
        finished = True
    finally:  # every rank ends here (its keeper then ends what it started), even when this call is interrupted
        for p in procs:
            p.join(timeout=60 if finished and not failures else 5)
            if p.is_alive():
                p.kill()
                p.join()
    return results, failures, port_taken
