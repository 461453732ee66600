"""Launch a job's ranks: the one dispatch every driver uses (`sao train` / `sft`, `sao value-pretrain train`).

Where the ranks run is decided by the launcher section alone (`rank_launcher`):

- `launcher.ray=true`: Ray actors in one placement group on a local Ray instance or the cluster
  at `launcher.ray_address` (`platform/ray_ranks.py`); the caller says how the group is sized and
  reserved (`RayRanksPlan`: `pipeline/placement.py` knows the bundles, this layer does not);
- else `launcher.kind=slurm`: the tasks of one srun step of the current Slurm job, on every node
  (`platform/srun.py`);
- else `launcher.nproc_per_node` local processes (`platform/spawn.py`); `launcher.nnodes` must
  then be 1.

Signals: the driver only waits, so SIGTERM / SIGINT reaching it go on to every rank, which
checkpoints and stops: to local children directly (`forward_to_children`), to Ray actors through
`RayRanks.forward_signal` (Ray does not pass the driver's signals on), to srun as its stop signal
(`run_srun` does that itself: srun would turn SIGTERM into SIGKILL for its tasks).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from megatron_sao.config.schema import LauncherConfig

RankLauncher = Literal["ray", "srun", "local"]


def rank_launcher(launcher: LauncherConfig, several_nodes_hint: str) -> RankLauncher:
    """Where `launcher`'s ranks run. ValueError for several nodes without Slurm or Ray, ending
    with `several_nodes_hint` (how this job is submitted to Slurm)."""
    if launcher.ray:
        return "ray"
    if launcher.kind == "slurm":
        return "srun"
    if launcher.nnodes != 1:
        raise ValueError(f"launcher.nnodes={launcher.nnodes} with launcher.kind=local: several nodes need "
                         f"launcher.kind=slurm ({several_nodes_hint})")
    return "local"


class RayRankPlacement(Protocol):
    """What launching ranks on Ray needs of a placement (`pipeline.placement.RayPlacement` is one)."""

    @property
    def bundle_count(self) -> int: ...

    def trainer_bundles(self) -> list[int]: ...

    def trainer_resources(self) -> tuple[float, float]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class RayRanksPlan:
    """The placement of a job's ranks on Ray and how to reserve it: `reserve(timeout_s)` returns a
    ready placement group or raises naming what the cluster lacks."""

    placement: RayRankPlacement
    reserve: Callable[[float], Any]


def forward_to_children(signum: int, frame: Any) -> None:
    """The parent only waits: pass the signal on so that every local rank checkpoints and stops."""
    for child in multiprocessing.active_children():
        if child.pid is not None:  # started
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)


@contextlib.contextmanager
def signals_to(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGTERM / SIGINT go to `handler` inside the block (the driver passes them on to its ranks)."""
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def launch_ranks(fn: Callable[..., Any], world_size: int, *args: Any, launcher: LauncherConfig, run_dir: Path,
                 announce: str, ray: RayRanksPlan | None = None) -> Any:
    """Call `fn(*args)` on `world_size` ranks where `launcher` says (`rank_launcher`) and return
    rank 0's result; a rank's failure raises `RankFailed` (`RankUserError` for a user error).
    `announce` is printed once the ranks' place is known, with where they go appended. srun and
    Ray ranks may run on other nodes: `run_dir` and every path in `args` must then be absolute and
    on a shared file system (srun's rank results travel through `run_dir/launch/`)."""
    where = rank_launcher(launcher, "submit with `sao launch slurm`")
    if where == "ray":
        if ray is None:
            raise TypeError("launcher.ray=true needs a RayRanksPlan (the placement of the ranks)")
        return _launch_on_ray(fn, world_size, args, launcher, announce, ray)
    if where == "srun":
        from megatron_sao.platform.srun import run_srun

        print(f"{announce}; {world_size} trainer ranks as srun tasks, {min(world_size, launcher.nproc_per_node)} "
              "per node", flush=True)
        return run_srun(fn, world_size, *args, ntasks_per_node=launcher.nproc_per_node, work_dir=run_dir / "launch")[0]
    from megatron_sao.platform.spawn import run_distributed

    print(announce, flush=True)
    with signals_to(forward_to_children):
        return run_distributed(fn, world_size, *args, timeout_s=float("inf"))[0]


def _launch_on_ray(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], launcher: LauncherConfig,
                   announce: str, plan: RayRanksPlan) -> Any:
    import ray

    from megatron_sao.platform.ray_ranks import RayRanks, connect_ray

    placement = plan.placement
    if len(placement.trainer_bundles()) != world_size:
        raise ValueError(f"the Ray placement has {len(placement.trainer_bundles())} trainer bundles for {world_size} "
                         "ranks")
    started = connect_ray(launcher.ray_address, min_cpus=placement.bundle_count)
    print(f"{announce}; {placement.describe()}", flush=True)
    group = None
    try:
        group = plan.reserve(float(launcher.join_timeout_s))
        ranks = RayRanks(world_size, group, placement.trainer_bundles(), *placement.trainer_resources())
        try:
            with signals_to(ranks.forward_signal):
                return ranks.run(fn, *args)[0]
        finally:
            ranks.kill()
    finally:
        if group is not None:
            ray.util.remove_placement_group(group)
        if started:
            ray.shutdown()
