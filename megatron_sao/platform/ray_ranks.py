"""Trainer ranks as Ray actors: `run_distributed` for a Ray cluster, one box or many nodes.

`run_ray_ranks(fn, world_size, *args, ...)` places rank r in bundle `bundle_of_rank[r]` of a
placement group, gives it the torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR = rank 0's node, MASTER_PORT free there), calls `fn(*args)` on every rank and returns
the results in rank order, like `platform.spawn.run_distributed`. A rank computes on the GPU Ray
assigned its actor (`ray.get_gpu_ids()`, see `platform.device`). A rank that raises, or whose
process dies, fails the call with `RankFailed` naming it, and the other ranks are killed rather
than left waiting in a collective.

Signals: Ray actors do not receive the driver's signals. `signal_ranks(SIGTERM)` sends one to
every rank's process, on whichever node it runs (a zero-CPU task pinned to that node), so a
preempted driver's ranks checkpoint and stop exactly as local ranks do.

`connect_ray(address)`: '' starts a local Ray instance (the embedded default), 'auto' or
HOST:PORT joins a running cluster (the one `sao launch slurm` starts).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from megatron_sao.platform.spawn import RankFailed, configure_rank_process, rank_failure, user_error_of
from megatron_sao.utils import lifetime


def connect_ray(address: str = "", min_cpus: float = 0.0) -> bool:
    """Make this process a Ray driver; returns True when this call started Ray (the caller shuts
    it down). A local instance offers at least `min_cpus` logical CPUs: placement is accounting,
    and a 2-core box must still place a trainer and an engine side by side."""
    import ray

    from megatron_sao.platform.ray_cluster import join_failure, use_explicit_auth

    if ray.is_initialized():
        return False
    lifetime.run_id()  # Ray's processes inherit the run's tag
    quiet = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    if address:
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, RuntimeError) as e:  # say why: the token refused, or nothing there
            raise ConnectionError(join_failure(address, e)[1]) from e
    else:
        use_explicit_auth()  # the same mode and token whatever ~/.ray/auth_token holds
        # A local instance dies with this process: Ray starts GCS and raylet with PR_SET_PDEATHSIG
        # (ray/_private/services.py start_ray_process -> utils.set_kill_on_parent_death_linux;
        # node.py kernel_fate_share; it follows the calling thread: drivers call this from their
        # main thread) and workers exit when the raylet is gone; but its dashboard and runtime-env
        # agents then wait up to 60 s to report that to the dead GCS, so a keeper ends them at once.
        before = lifetime.children()
        ray.init(num_cpus=max(os.cpu_count() or 1, int(min_cpus + 0.999)), **quiet)
        lifetime.reap_with_this_process(lifetime.children() - before)
    return True


class _RankWorker:
    """One trainer rank (a Ray actor: its methods run on the worker process's main thread, so
    `fn` may install signal handlers as a spawned rank does)."""

    def address(self) -> tuple[str, str, int]:
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port

    def pid(self) -> int:
        return os.getpid()

    def run(self, env: dict[str, str], threads: int, fn: Callable[..., Any], args: tuple) -> Any:
        lifetime.lead_process_group()  # what the rank starts ends with it, even if its worker is killed
        os.environ.update(env)
        rank = int(env["RANK"])
        configure_rank_process(rank, threads)
        import ray

        from megatron_sao.platform.distributed import destroy_distributed, init_distributed

        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            # Ray set this actor's CUDA_VISIBLE_DEVICES to the GPU it assigned (LOCAL_RANK, the
            # index among the node's ranks, is not a device index here): platform.device's rule.
            init_distributed(assigned_gpu_ids=[str(gpu) for gpu in ray.get_gpu_ids()])
            return fn(*args)
        finally:
            with contextlib.suppress(Exception):  # teardown after a failure must not mask it
                destroy_distributed()
            for s, handler in previous.items():
                signal.signal(s, handler)


class RayRanks:
    """The rank actors of one job; `run` them once, `signal` them any time, `kill` them at the end."""

    def __init__(self, world_size: int, placement_group: Any, bundle_of_rank: Sequence[int],
                 num_cpus: float, num_gpus: float) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if len(bundle_of_rank) != world_size:
            raise ValueError(f"bundle_of_rank has {len(bundle_of_rank)} entries for {world_size} ranks")
        actor = ray.remote(_RankWorker)
        self.world_size = world_size
        self.actors = [
            actor.options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, scheduling_strategy=(
                PlacementGroupSchedulingStrategy(placement_group=placement_group,
                                                 placement_group_bundle_index=bundle_of_rank[r]))).remote()
            for r in range(world_size)
        ]
        addresses = ray.get([a.address.remote() for a in self.actors])
        self.node_ids = [node for node, _, _ in addresses]
        self.pids: list[int] = ray.get([a.pid.remote() for a in self.actors])
        self.master_addr, self.master_port = addresses[0][1], addresses[0][2]
        self.threads_per_rank = max(1, int(num_cpus))
        self._signals: list[int] = []

    def forward_signal(self, signum: int, frame: Any = None) -> None:
        """A signal handler for the driver: `run` passes the signal on to every rank (from its
        loop, not from inside the handler, which may interrupt a Ray call)."""
        self._signals.append(signum)

    def environment(self, rank: int) -> dict[str, str]:
        same_node = [r for r in range(self.world_size) if self.node_ids[r] == self.node_ids[rank]]
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(same_node.index(rank)), "LOCAL_WORLD_SIZE": str(len(same_node)),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = float("inf")) -> list[Any]:
        import ray

        refs = [a.run.remote(self.environment(r), self.threads_per_rank, fn, args) for r, a in enumerate(self.actors)]
        rank_of = {ref: r for r, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            while self._signals:
                self.signal(self._signals.pop(0))
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except Exception as error:  # RayTaskError carries the rank's traceback
                    self.kill()
                    raise rank_failure([(rank, str(error), user_error_of(getattr(error, "cause", None)))]) from None
            if pending and time.monotonic() > deadline:
                self.kill()
                raise RankFailed(f"timed out after {timeout_s:.0f} s waiting for ranks "
                                 f"{sorted(rank_of[ref] for ref in pending)}")
        return [results[r] for r in range(self.world_size)]

    def signal(self, signum: int) -> None:
        """Send `signum` to every rank's process, on its own node."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        send = ray.remote(num_cpus=0)(_send_signal)
        refs = [send.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pid, signum)
                for node, pid in zip(self.node_ids, self.pids, strict=True)]
        with contextlib.suppress(Exception):
            ray.get(refs, timeout=30)

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)


def _send_signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
