"""Where trainers and rollout engines run: GPU counts and colocated vs disaggregated.

A recipe asks for `launcher.nnodes x launcher.nproc_per_node` GPUs. The trainers (actor and
critic share the same ranks) take `parallelism.world_size` of them, all when unset. SGLang
engines take `rollout.sglang.tensor` GPUs each (`--ep-size` and `--dp-size` subdivide those same
GPUs). With trainers on every GPU the engines are colocated with them (both resident at once:
SAO is asynchronous, engines keep generating while the trainers step); otherwise they run on
the GPUs the trainers leave free (disaggregated), which must be enough.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_sao.config import ConfigError
from megatron_sao.config.schema import SaoConfig
from megatron_sao.config.validate import trainer_world_size

Placement = Literal["colocated", "disaggregated", "no_gpu_engines"]


@dataclass(frozen=True, slots=True)
class GpuLayout:
    total_gpus: int
    trainer_gpus: int
    engine_gpus: int
    """GPUs the engines use (0 for CPU engines)."""
    gpus_per_engine: int
    placement: Placement
    engine_nodes: int
    """Whole nodes the engines need when disaggregated (0 otherwise)."""


def gpu_layout(config: SaoConfig) -> GpuLayout:
    """The recipe's GPU split; ConfigError naming the keys when it asks for more than it has."""
    launcher, rollout = config.launcher, config.rollout
    total = launcher.nnodes * launcher.nproc_per_node
    trainers = trainer_world_size(config)
    per_engine = rollout.sglang.tensor if rollout.engine == "sglang" else 0
    engines = rollout.num_engines * per_engine
    wanted = launcher.engine_placement
    if trainers > total:
        raise ConfigError(f"parallelism.world_size = {trainers} trainer GPUs but launcher.nnodes x "
                          f"launcher.nproc_per_node = {launcher.nnodes} x {launcher.nproc_per_node} = {total}")
    if engines == 0:
        return GpuLayout(total, trainers, 0, 0, "no_gpu_engines", 0)
    placement: Placement = "colocated" if trainers == total else "disaggregated"
    if wanted in ("colocated", "disaggregated"):
        placement = wanted
    if placement == "colocated" and engines > trainers:
        raise ConfigError(f"rollout.num_engines x rollout.sglang.tensor = {rollout.num_engines} x "
                          f"{rollout.sglang.tensor} = {engines} engine GPUs, more than the {trainers} trainer "
                          "GPUs they are colocated with")
    if placement == "disaggregated" and trainers + engines > total:
        raise ConfigError(
            f"{trainers} trainer GPUs (parallelism.world_size) + rollout.num_engines x rollout.sglang.tensor = "
            f"{rollout.num_engines} x {rollout.sglang.tensor} = {engines} engine GPUs exceed launcher.nnodes x "
            f"launcher.nproc_per_node = {launcher.nnodes} x {launcher.nproc_per_node} = {total}"
        )
    engine_nodes = -(-engines // launcher.nproc_per_node) if placement == "disaggregated" else 0
    return GpuLayout(total, trainers, engines, per_engine, placement, engine_nodes)
