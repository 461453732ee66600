"""Rollout engines as Ray actors: the engine supervisor for runs placed on Ray.

Each engine gets an `_EngineHost` actor in its placement-group bundle, on whichever node Ray put
that bundle. The host runs an `EngineSupervisor` of that one engine: the server is a child process
of the actor, listens on the node's IP, and is restarted by the host when it dies (same URL, so
the engine pool's clients keep working). `RayEngineSupervisor` gathers the hosts behind the
interface `RolloutService` uses for local engines (`start`, `start_monitor`, `alive`, `kill`,
`total_restarts`, `set_weights`, `stop`).

GPU engines: Ray would confine an actor to the GPUs it requested; an engine spanning
`gpus_per_engine` GPUs (SGLang TP) needs them all, so the host asks Ray not to set
CUDA_VISIBLE_DEVICES and starts the server at the first GPU Ray assigned it (`--base-gpu-id`);
the engine's other bundles reserve the following GPUs of that node.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from megatron_sao.rollout.engine_supervisor import EngineConfig, EngineSupervisor

_NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class _EngineHost:
    """One engine server on the node Ray placed this actor on."""

    def __init__(self, config: EngineConfig, index: int) -> None:
        import ray

        gpu_ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        self.supervisor = EngineSupervisor(dataclasses.replace(
            config, num_engines=1, first_index=index, host=ray.util.get_node_ip_address(), base_port=0,
            base_gpu_id=int(gpu_ids[0]) if gpu_ids else config.base_gpu_id))

    def start(self) -> str:
        return self.supervisor.start()[0]

    def start_monitor(self) -> None:
        self.supervisor.start_monitor()

    def alive(self) -> bool:
        return self.supervisor.alive(0)

    def restarts(self) -> int:
        return self.supervisor.total_restarts()

    def kill(self, sig: int) -> None:
        self.supervisor.kill(0, sig)

    def set_weights(self, model_path: str, weight_version: str) -> None:
        self.supervisor.set_weights(model_path, weight_version)

    def stop(self) -> None:
        self.supervisor.stop()


class RayEngineSupervisor:
    """The run's engines, one `_EngineHost` actor each, in the bundles `placement` gives them."""

    def __init__(self, config: EngineConfig, placement_group: Any, bundle_of_engine: list[int],
                 num_cpus: float, num_gpus: float) -> None:
        config.validate()
        self.config = config
        self.placement_group = placement_group
        self.bundle_of_engine = bundle_of_engine
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.hosts: list[Any] = []
        self.urls: list[str] = []

    def start(self) -> list[str]:
        """Start every engine (on its node) and wait until all are healthy; returns their URLs."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        host = ray.remote(_EngineHost)
        env = {_NOSET_CUDA: "1"} if self.num_gpus else {}
        for index in range(self.config.num_engines):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                        placement_group_bundle_index=self.bundle_of_engine[index])
            self.hosts.append(host.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0,
                                           scheduling_strategy=strategy, runtime_env={"env_vars": env})
                              .remote(self.config, index))
        try:
            self.urls = ray.get([h.start.remote() for h in self.hosts])
        except BaseException:
            self.stop()
            raise
        return self.urls

    def start_monitor(self) -> None:
        import ray

        ray.get([h.start_monitor.remote() for h in self.hosts])

    def alive(self, index: int) -> bool:
        import ray

        try:
            return bool(ray.get(self.hosts[index].alive.remote(), timeout=30))
        except Exception:  # the host itself is gone or does not answer: its engine is not alive
            return False

    def total_restarts(self) -> int:
        import ray

        counts = []
        for h in self.hosts:
            with contextlib.suppress(Exception):
                counts.append(ray.get(h.restarts.remote(), timeout=30))
        return int(sum(counts))

    def kill(self, index: int, sig: int = 9) -> None:
        """Send `sig` to engine `index`'s server process (hang recovery, fault drills)."""
        import ray

        ray.get(self.hosts[index].kill.remote(sig))

    def set_weights(self, model_path: str, weight_version: str) -> None:
        """Engines restarted from now on load `model_path` at `weight_version` (disk weight sync)."""
        import ray

        ray.get([h.set_weights.remote(model_path, weight_version) for h in self.hosts])

    def stop(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.get([h.stop.remote() for h in self.hosts], timeout=60)
        for h in self.hosts:
            with contextlib.suppress(Exception):
                ray.kill(h)
        self.hosts = []
