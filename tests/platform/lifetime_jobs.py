"""Drivers for the lifetime tests, and what they look for afterwards.

Each scenario runs as a driver process of its own (`python -m tests.platform.lifetime_jobs MODE
DIR`) with a fresh SAO_RUN_ID in its environment, which every process it starts inherits; the test
then ends the run one way or another and waits until no live process carries that id
(`wait_for_none`). Ready markers are files in DIR.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from megatron_sao.utils.lifetime import RUN_ID_ENV

REPO = Path(__file__).resolve().parents[2]


# ---- the test's side ---------------------------------------------------------------------------

def new_run_env() -> tuple[str, dict[str, str]]:
    """A fresh run id and the environment of a driver tagged with it."""
    run = f"lifetime-test-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, RUN_ID_ENV: run, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    return run, env


def tagged(run: str) -> dict[int, str]:
    """pid -> command line of every live (not zombie) process whose environment has SAO_RUN_ID=run."""
    needle = f"{RUN_ID_ENV}={run}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:  # gone while we looked
            continue
    return found


def alive(pids: set[int]) -> set[int]:
    """The pids of `pids` that name a live process (not a zombie)."""
    left = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                    left.add(pid)
        except OSError:
            continue
    return left


def wait_for_none(run: str, timeout_s: float, also: set[int] = frozenset()) -> tuple[float, dict[int, str]]:
    """Wait until no process of `run` (nor of `also`) is alive: (seconds waited, what is left)."""
    start = time.monotonic()
    while True:
        left = tagged(run)
        left.update({pid: "(untagged descendant)" for pid in alive(set(also)) if pid not in left})
        if not left or time.monotonic() - start > timeout_s:
            return time.monotonic() - start, left
        time.sleep(0.1)


def wait_for_file(path: Path, timeout_s: float, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the driver exited with {proc.returncode} before {path.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path} after {timeout_s} s")
        time.sleep(0.1)


# ---- what ranks and actors run ----------------------------------------------------------------------

def start_write_results_manager() -> Any:
    """What Megatron's torch_dist writer starts in every rank that saves: a multiprocessing Manager
    server, spawn context (megatron/core/dist_checkpointing/strategies/filesystem_async.py
    `get_write_results_queue`), stopped only by a finalizer of a cleanly exiting parent."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Manager().Queue()


def rank_job(action: str, ready_dir: str) -> None:
    """A rank: start the Manager, mark itself ready, then `exit` (rank 0 exits at once, as a rank
    killed inside a checkpoint save does) or `sleep`."""
    import torch.distributed as dist

    keep = start_write_results_manager()
    rank = dist.get_rank()
    Path(ready_dir, f"rank{rank}").touch()
    if action == "exit" and rank == 0:
        while len(list(Path(ready_dir).glob("rank*"))) < dist.get_world_size():
            time.sleep(0.05)
        os._exit(17)
    time.sleep(600)
    del keep


class Holder:
    """A Ray actor that starts what a rank or an engine host starts: a Manager in its own process
    group, and a child under a keeper."""

    def start(self, ready_dir: str) -> int:
        from megatron_sao.utils.lifetime import lead_process_group, start_child

        lead_process_group()
        self.manager = start_write_results_manager()
        self.child = start_child(["sleep", "600"])
        Path(ready_dir, f"actor{os.getpid()}").touch()
        return os.getpid()


def raising_train_rank(config: Any, run_dir: str, mode: str, resume_from: str | None) -> Any:
    """`jobs.train.train_rank` whose second step raises (an exception inside a rank)."""
    from megatron_sao.jobs.train import train_rank
    from megatron_sao.training.trainer import SaoTrainer

    original = SaoTrainer.train_step

    def train_step(self: Any, batch: Any) -> Any:
        if self.state.step >= 1:
            raise RuntimeError("lifetime test: a rank raises in its second step")
        return original(self, batch)

    SaoTrainer.train_step = train_step
    return train_rank(config, run_dir, mode, resume_from)


# ---- the drivers ---------------------------------------------------------------------------------

def main(mode: str, ready_dir: str, *rest: str) -> int:
    ready = Path(ready_dir)
    if mode in ("ranks-exit", "ranks-sleep"):
        from megatron_sao.platform import RankFailed, run_distributed

        try:
            run_distributed(rank_job, 2, mode.removeprefix("ranks-"), ready_dir, timeout_s=600)
        except RankFailed:
            (ready / "rank_failed").touch()
            return 0
        return 1
    if mode == "sandbox":
        from megatron_sao.rollout.sandbox import run_python

        thread = threading.Thread(target=run_python, args=("import time\ntime.sleep(600)",),
                                  kwargs={"timeout_s": 600}, daemon=True)
        thread.start()
        time.sleep(600)
        return 0
    if mode == "ray":
        import ray

        from megatron_sao.platform.ray_ranks import connect_ray

        connect_ray("", min_cpus=2)
        holders = [ray.remote(Holder).options(num_cpus=0).remote() for _ in range(2)]
        ray.get([h.start.remote(ready_dir) for h in holders])
        (ready / "ray_ready").touch()
        time.sleep(600)
        return 0
    if mode == "train-raising":  # `sao train` whose ranks raise in their second step
        import megatron_sao.jobs.train as train_job
        from megatron_sao.cli import main as sao

        train_job.train_rank = raising_train_rank
        return sao(["train", *rest])
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
