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

from megatron_sao.config.errors import ConfigError
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


def engine_placement(config: SaoConfig) -> Literal["colocated", "disaggregated"]:
    """Where the run's engines are, resolved once for everything that depends on it (Ray
    bundles, suspending engines while the trainer steps, the memory saver, weight-sync defaults):
    SGLang engines as `gpu_layout` resolves `launcher.engine_placement` (auto: colocated when the
    trainers take every GPU); CPU engines colocated only when the recipe says so."""
    if config.rollout.engine == "sglang":
        return "colocated" if gpu_layout(config).placement == "colocated" else "disaggregated"
    return "colocated" if config.launcher.engine_placement == "colocated" else "disaggregated"


def weight_sync_mode(config: SaoConfig) -> Literal["tensor", "distributed", "disk"]:
    """`rollout.weight_sync.mode`, with `auto` resolved by placement: SGLang engines colocated with
    the trainers get tensors (CUDA IPC from the GPUs they share), disaggregated ones a process
    group with trainer rank 0 (NCCL); CPU engines take tensors (safetensors bytes over HTTP reach
    any node)."""
    mode = config.rollout.weight_sync.mode
    if mode != "auto":
        return mode
    if config.rollout.engine == "sglang" and engine_placement(config) == "disaggregated":
        return "distributed"
    return "tensor"


def trainer_gpus_on_first_node(config: SaoConfig) -> int:
    """GPUs the trainer ranks take on trainer rank 0's node (ranks fill nodes in order)."""
    return min(trainer_world_size(config), config.launcher.nproc_per_node)


def check_engine_layout(config: SaoConfig) -> None:
    """ConfigError naming the keys for SGLang engine layouts that cannot work (config load):
    weight-sync mode x placement, engines outside Ray on other nodes, engines spanning nodes,
    DP attention that does not divide the engine's TP."""
    rollout, launcher = config.rollout, config.launcher
    if rollout.engine != "sglang":
        return
    try:
        layout = gpu_layout(config)
    except ConfigError:  # a GPU split that does not add up: `sao plan` / the launcher name it where it matters
        return
    sglang = rollout.sglang
    placement = engine_placement(config)
    mode = weight_sync_mode(config)
    where = (f"launcher.engine_placement={launcher.engine_placement} resolves to {placement} (parallelism.world_size "
             f"{layout.trainer_gpus} of launcher.nnodes x launcher.nproc_per_node = {layout.total_gpus} GPUs)")
    if sglang.data > 1 and sglang.tensor % sglang.data:
        raise ConfigError(f"rollout.sglang.data = {sglang.data} (SGLang --attn-dp-size: attention data parallel "
                          f"inside the engine's TP group) must divide rollout.sglang.tensor = {sglang.tensor}")
    if sglang.tensor > launcher.nproc_per_node:
        if sglang.tensor % launcher.nproc_per_node:
            raise ConfigError(f"rollout.sglang.tensor = {sglang.tensor} GPUs per engine spans nodes, so it must be a "
                              f"multiple of launcher.nproc_per_node = {launcher.nproc_per_node} (whole nodes)")
        if not launcher.ray:
            raise ConfigError(
                f"rollout.sglang.tensor = {sglang.tensor} GPUs per engine spans nodes of launcher.nproc_per_node = "
                f"{launcher.nproc_per_node} GPUs: multi-node engines are started on Ray only (one engine host per "
                "node, pipeline/ray_engines.py); set launcher.ray=true")
    if mode == "tensor" and placement == "disaggregated":
        raise ConfigError(f"rollout.weight_sync.mode=tensor sends CUDA IPC handles, which only engines on the "
                          f"trainers' GPUs can open, but {where}; use rollout.weight_sync.mode=distributed (or auto)")
    if mode == "tensor" and rollout.num_engines * sglang.tensor > launcher.nproc_per_node:
        raise ConfigError(
            f"rollout.weight_sync.mode=tensor: trainer rank 0 sends CUDA IPC handles of its GPU, which only processes "
            f"on its node can open, but rollout.num_engines x rollout.sglang.tensor = {rollout.num_engines} x "
            f"{sglang.tensor} engine GPUs exceed launcher.nproc_per_node = {launcher.nproc_per_node}; use "
            "rollout.weight_sync.mode=disk or fewer engines")
    if mode == "distributed" and placement == "colocated":
        raise ConfigError(f"rollout.weight_sync.mode=distributed with colocated engines ({where}): NCCL cannot hold "
                          "trainer rank 0 and the engine on its GPU in one communicator; use "
                          "rollout.weight_sync.mode=tensor (or auto)")
    free_on_first = launcher.nproc_per_node - trainer_gpus_on_first_node(config)
    if placement == "disaggregated" and not launcher.ray and layout.engine_gpus > free_on_first:
        raise ConfigError(
            f"without launcher.ray the engines start on trainer rank 0's node, which has {free_on_first} GPU(s) "
            f"left of launcher.nproc_per_node = {launcher.nproc_per_node}, but rollout.num_engines x "
            f"rollout.sglang.tensor = {rollout.num_engines} x {sglang.tensor} = {layout.engine_gpus}; set "
            "launcher.ray=true (engines placed on the allocation's other GPUs, pipeline/placement.py)")
