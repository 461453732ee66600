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

Engines spanning nodes (DeepSeek-V3, GLM-5: TP 16 over two 8-GPU nodes): one host per node of
the engine, in the bundle that starts that node's share (bundle of the engine + j x GPUs per
node); node rank 0's host picks the rendezvous port on its node and the others join it there
(`--nnodes`, `--node-rank`, `--dist-init-addr`, platform/engine_nodes.py). Only node rank 0
serves HTTP. A part cannot rejoin the others alone, so a multi-node engine is not restarted:
when one of its parts dies, the engine stays down (the pool stops routing to it).
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
        part = config.nnodes > 1
        self.supervisor = EngineSupervisor(dataclasses.replace(
            config, num_engines=1, first_index=index, host=ray.util.get_node_ip_address(), base_port=0,
            base_gpu_id=int(gpu_ids[0]) if gpu_ids else config.base_gpu_id,
            max_restarts=0 if part else config.max_restarts))

    @staticmethod
    def rendezvous() -> str:
        """HOST:PORT on this node where the parts of a multi-node engine meet (node rank 0)."""
        import ray

        from megatron_sao.rollout.engine_supervisor import free_port

        ip = ray.util.get_node_ip_address()
        return f"{ip}:{free_port(ip)}"

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
                 num_cpus: float, num_gpus: float, gpus_per_node: int | None = None) -> None:
        config.validate()
        self.config = config
        self.placement_group = placement_group
        self.bundle_of_engine = bundle_of_engine
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        engine_gpus = config.tp_size * config.pp_size * config.dp_size
        self.gpus_per_node = gpus_per_node or engine_gpus
        self.nodes_per_engine = max(1, -(-engine_gpus // self.gpus_per_node))
        self.parts: list[list[Any]] = []
        """Per engine, its hosts in node-rank order (one for an engine within a node)."""
        self.urls: list[str] = []

    @property
    def hosts(self) -> list[Any]:
        return [part for parts in self.parts for part in parts]

    def _host(self, config: EngineConfig, index: int, bundle: int) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                    placement_group_bundle_index=bundle)
        env = {_NOSET_CUDA: "1"} if self.num_gpus else {}
        return (ray.remote(_EngineHost).options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0,
                                                scheduling_strategy=strategy, runtime_env={"env_vars": env})
                .remote(config, index))

    def start(self) -> list[str]:
        """Start every engine (on its node or nodes) and wait until all are healthy; returns their URLs."""
        import ray

        k = self.nodes_per_engine
        try:
            for index in range(self.config.num_engines):
                bundle = self.bundle_of_engine[index]
                if k == 1:
                    self.parts.append([self._host(self.config, index, bundle)])
                    continue
                head_config = dataclasses.replace(self.config, nnodes=k, node_rank=0, dist_init_addr="pending")
                head = self._host(head_config, index, bundle)
                address = ray.get(head.rendezvous.remote())
                head_config = dataclasses.replace(head_config, dist_init_addr=address)
                ray.kill(head)  # placed to learn its node's address; restarted with it below
                self.parts.append([self._host(dataclasses.replace(head_config, node_rank=j), index,
                                              bundle + j * self.gpus_per_node) for j in range(k)])
            started = ray.get([h.start.remote() for parts in self.parts for h in parts])
            self.urls = [started[i * k] for i in range(self.config.num_engines)]  # node rank 0 serves HTTP
        except BaseException:
            self.stop()
            raise
        return self.urls

    def start_monitor(self) -> None:
        import ray

        ray.get([h.start_monitor.remote() for h in self.hosts])

    def alive(self, index: int) -> bool:
        """Every part of engine `index` runs."""
        import ray

        try:
            return all(ray.get([h.alive.remote() for h in self.parts[index]], timeout=30))
        except Exception:  # a host itself is gone or does not answer: its engine is not alive
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

        ray.get([h.kill.remote(sig) for h in self.parts[index]])

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
        self.parts = []
