"""The trainer of a recipe built as rank 0 of its world, shapes only: what `sao train --dry-run`
(`jobs/dry_run.py`) builds without GPUs, peers, data or weights.

`shape_only_config` turns off every weight read and initialisation (and writes a tiny model's
config.json instead of building its checkpoint); `build_rank0` builds `SaoTrainer` (the actor, the
critic when the estimator needs one, their Megatron DDP wrappers, optimizers and LR schedules) in
a fake world (`platform/fake_world.py`: fake process group of the recipe's world size, meta
tensors) at the recipe's real shapes with no memory behind them, and counts each role's parameters
beside the planner's figures for the same rank (`planning.memory.rank_parameters`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_sao.config.schema import SaoConfig

Mode = Literal["rl", "sft"]
NOISY_LOGGERS = ("megatron.core", "megatron.bridge", "modelopt", "transformers", "megatron_sao.models.build")


@dataclass(frozen=True, slots=True)
class RoleBuild:
    """One role as built on rank 0, beside the plan's figures for the same rank."""

    role: str
    params: int
    trainable: int
    optimizer_elems: int
    """Elements of the parameters the optimizer steps on this rank (its shard of the trainable ones)."""
    plan_params: float
    plan_trainable: float
    plan_optimizer_elems: float


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Megatron, megatron-bridge and modelopt log every bucket and plugin while building."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def shape_only_config(config: SaoConfig, scratch: Path) -> SaoConfig:
    """The config the dry run builds: no weights loaded or initialised, and a tiny model's
    config.json written to `scratch` instead of its checkpoint being built."""
    from megatron_sao.planning import load_hf_config

    shape = copy.deepcopy(config)
    model = shape.model
    if model.build_tiny and not (Path(model.hf_path) / "config.json").is_file():
        (scratch / "config.json").write_text(json.dumps(load_hf_config(model)))
        model.hf_path, model.build_tiny = str(scratch), False
    model.load_weights = False
    model.provider_overrides = {**model.provider_overrides, "perform_initialization": False}
    shape.actor.load = shape.critic.load = ""
    shape.logging.param_table = False
    return shape


def _role_counts(role: Any) -> tuple[int, int, int]:
    params = [p for chunk in role.chunks for p in chunk.parameters()]
    optimizers = getattr(role.optimizer, "chained_optimizers", None) or [role.optimizer]
    stepped = sum(p.numel() for opt in optimizers for group in opt.optimizer.param_groups for p in group["params"])
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad), stepped


def build_rank0(config: SaoConfig, mode: Mode, census: Any) -> list[RoleBuild]:
    """Build `SaoTrainer(config, mode)` as rank 0 of the recipe's world in a fake world; its roles'
    counts beside the plan's for pipeline stage 0."""
    from megatron_sao.config.validate import trainer_world_size
    from megatron_sao.planning.memory import rank_parameters
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.platform.fake_world import fake_world, meta_tensors
    from megatron_sao.training.trainer import SaoTrainer

    with fake_world(trainer_world_size(config), rank=0):
        init_model_parallel(config.parallelism, seed=config.run.seed)
        with meta_tensors():
            trainer = SaoTrainer(config, mode=mode)
        builds = []
        for name, role in trainer.roles.items():
            plan = rank_parameters(config, census, stage=0, critic=name == "critic")
            builds.append(RoleBuild(name, *_role_counts(role), plan.params, plan.trainable, plan.optimizer_elems))
        if trainer.router_load is not None:
            trainer.router_load.close()
    return builds
