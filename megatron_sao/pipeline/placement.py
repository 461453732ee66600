"""Placement on Ray: one placement group per run, sized from the config, for trainer ranks, engines
and the rollout (agent loop, ready buffer).

The same code runs on one CPU box (a local Ray instance, `launcher.ray_address=''`) and on N GPU
nodes (the cluster `sao launch slurm` starts, `launcher.ray_address=auto`). A bundle is one
device: {GPU: 1, CPU: 1} on GPU machines, {CPU: 1} on CPU ones.

```
colocated      bundles 0..T-1            trainer rank r in bundle r (half of it);
                                         engine i in bundle i x gpus_per_engine (the other half):
                                         they time-share the device (engines release their memory
                                         while the trainer steps, docs/pipeline.md)
disaggregated  bundles 0..T-1            trainer rank r in bundle r (all of it)
               bundles T..T+E x g - 1    engine i in bundles T + i x g .. (g = gpus per engine, 1
                                         for CPU engines): generation never stops for training
both, with engines: the last bundle      {CPU: 1}: the rollout actor (agent loop, engine supervisor,
                                         ready buffer, prompt stream; `pipeline/rollout_actor.py`)
```

`auto` resolves as `sao plan` does (`config.placement.gpu_layout`): colocated when the trainers
take every GPU of the allocation, disaggregated otherwise; CPU engines are disaggregated unless
the recipe says colocated.

The rollout gets a CPU bundle of its own rather than a share of trainer rank 0's: its agent loop
(tokenising, environments, rewards, thousands of in-flight requests at scale) is CPU work that the
group should reserve, not take from a trainer rank's accounting (which sets that rank's torch
threads); trainer and engine bundle indices stay as they were; and PACK keeps it on the run's
nodes. Trainer rank 0 is the only trainer rank that talks to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from megatron_sao.config.schema import SaoConfig

if TYPE_CHECKING:
    from megatron_sao.rollout.serving import EngineFleet

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RayPlacement:
    placement: Literal["colocated", "disaggregated"]
    trainer_ranks: int
    num_engines: int
    """0 when the run starts no engine (SFT, recorded trajectories)."""
    devices_per_engine: int
    """Bundles one engine spans (its GPUs; 1 for a CPU engine)."""
    use_gpus: bool

    @property
    def device_bundle_count(self) -> int:
        """Bundles of trainers and engines (one device each)."""
        if self.placement == "colocated":
            return self.trainer_ranks
        return self.trainer_ranks + self.num_engines * self.devices_per_engine

    @property
    def has_rollout(self) -> bool:
        """Whether the run has a rollout actor (it has engines)."""
        return self.num_engines > 0

    @property
    def bundle_count(self) -> int:
        return self.device_bundle_count + (1 if self.has_rollout else 0)

    def bundles(self) -> list[dict[str, float]]:
        device = {"CPU": 1.0, "GPU": 1.0} if self.use_gpus else {"CPU": 1.0}
        rollout = [{"CPU": 1.0}] if self.has_rollout else []
        return [dict(device) for _ in range(self.device_bundle_count)] + rollout

    def rollout_bundle(self) -> int:
        """The rollout actor's bundle (CPU only): the last one."""
        if not self.has_rollout:
            raise ValueError("a placement without engines has no rollout bundle")
        return self.device_bundle_count

    def trainer_bundles(self) -> list[int]:
        return list(range(self.trainer_ranks))

    def engine_bundles(self) -> list[int]:
        if self.placement == "colocated":
            return [(i * self.devices_per_engine) % self.trainer_ranks for i in range(self.num_engines)]
        return [self.trainer_ranks + i * self.devices_per_engine for i in range(self.num_engines)]

    def _share(self) -> float:
        """The part of a bundle a colocated engine host takes (several CPU engines may share one)."""
        per_bundle = max(self.engine_bundles().count(b) for b in set(self.engine_bundles()))
        return 0.5 / per_bundle

    def trainer_resources(self) -> tuple[float, float]:
        """(num_cpus, num_gpus) of one trainer rank actor."""
        share = 0.5 if self.placement == "colocated" and self.num_engines else 1.0
        return share, (share if self.use_gpus else 0.0)

    def engine_resources(self) -> tuple[float, float]:
        """(num_cpus, num_gpus) of one engine host actor (the rest of an engine's GPUs stay reserved
        in its other bundles)."""
        share = self._share() if self.placement == "colocated" else 1.0
        return share, (share if self.use_gpus else 0.0)

    def describe(self) -> str:
        rollout = f", rollout in {self.rollout_bundle()} (CPU)" if self.has_rollout else ""
        return (f"Ray placement: {self.placement}, {self.device_bundle_count} bundles of "
                f"{'GPU+CPU' if self.use_gpus else 'CPU'}{' + 1 CPU' if self.has_rollout else ''}: trainer ranks in "
                f"{self.trainer_bundles()}, engines in {self.engine_bundles()}{rollout}")


def ray_placement(config: SaoConfig, with_engines: bool) -> RayPlacement:
    """The placement of `config`'s trainer ranks and (when `with_engines`) its rollout engines."""
    import torch

    from megatron_sao.config.placement import engine_placement
    from megatron_sao.config.validate import trainer_world_size

    trainers = trainer_world_size(config)
    gpu_engines = config.rollout.engine == "sglang"
    engines = config.rollout.num_engines if with_engines else 0
    placement = engine_placement(config)
    per_engine = config.rollout.sglang.tensor if gpu_engines else 1
    # GPU bundles where this machine has GPUs, or where SGLang engines will need them; a run without
    # engines (SFT, value pretraining) on a CPU box gets CPU bundles whatever rollout.engine says.
    use_gpus = torch.cuda.is_available() or (gpu_engines and engines > 0)
    return RayPlacement(placement=placement, trainer_ranks=trainers, num_engines=engines,
                        devices_per_engine=per_engine, use_gpus=use_gpus)


def create_placement_group(placement: RayPlacement, timeout_s: float = 600.0) -> Any:
    """Reserve the bundles (PACK: as few nodes as possible); a clear error when the cluster cannot
    hold them within `timeout_s`."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group(placement.bundles(), strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster could not reserve {placement.bundle_count} bundles "
                           f"{placement.bundles()[0]} within {timeout_s:.0f} s ({placement.describe()}); "
                           f"cluster resources: {ray.cluster_resources()}")
    logger.info("%s", placement.describe())
    return group


def _current_placement_group() -> Any:
    """The placement group this process was placed in by Ray, or None (no Ray, or not placed)."""
    try:
        import ray
    except ImportError:
        return None
    return ray.util.get_current_placement_group() if ray.is_initialized() else None


def make_engine_supervisor(config: SaoConfig) -> Callable[[Any], EngineFleet] | None:
    """The engine supervisor factory of this run: Ray actors in the run's placement group when
    this process is a rank placed by Ray, None otherwise (local engine processes); what it makes
    is a `rollout.serving.EngineFleet`."""
    group = _current_placement_group()
    if group is None:
        return None
    from megatron_sao.pipeline.ray_engines import RayEngineSupervisor

    placement = ray_placement(config, with_engines=True)
    num_cpus, num_gpus = placement.engine_resources()

    def supervisor(engine_config: Any) -> RayEngineSupervisor:
        return RayEngineSupervisor(engine_config, group, placement.engine_bundles(), num_cpus, num_gpus,
                                   gpus_per_node=config.launcher.nproc_per_node if placement.use_gpus else None)

    return supervisor


def make_rollout_actor(config: SaoConfig, run_dir: Any) -> Any:
    """The run's rollout as a Ray actor in its bundle of the placement group (a `RemoteRollout`,
    `pipeline/rollout_actor.py`) when this process is a rank placed by Ray; None otherwise (the
    rollout then runs in this process)."""
    group = _current_placement_group()
    if group is None:
        return None
    from megatron_sao.pipeline.rollout_actor import RemoteRollout

    placement = ray_placement(config, with_engines=True)
    return RemoteRollout(config, run_dir, group, placement.rollout_bundle(), make_engine_supervisor(config))


def ray_ranks_plan(config: SaoConfig, with_engines: bool) -> Any:
    """`config`'s trainer ranks on Ray for `platform.launch.launch_ranks`: the placement (with the
    engines' and rollout's bundles when `with_engines`) and how to reserve it."""
    from functools import partial

    from megatron_sao.platform.launch import RayRanksPlan

    placement = ray_placement(config, with_engines=with_engines)
    return RayRanksPlan(placement, partial(create_placement_group, placement))
