"""Cross-field checks: combinations that would fail (or silently misbehave) later are rejected
before anything starts. Field types are already checked by the loader, and the range of every
single numeric field by `ranges.py` (which runs first)."""

from __future__ import annotations

from typing import Any

from megatron_sao.config.errors import ConfigError
from megatron_sao.config.rollout_names import check_rollout_name
from megatron_sao.config.schema import SaoConfig

# Must equal ("all",) + megatron_sao.models.param_groups.GROUPS (a test checks it; config imports nothing).
PARAM_GROUPS = ("all", "attention", "experts", "router", "shared_experts", "dense_mlp", "embedding", "norms", "head")


def trainer_world_size(config: SaoConfig) -> int:
    """Trainer processes per role: explicit, or nnodes x nproc_per_node."""
    p = config.parallelism
    return p.world_size if p.world_size is not None else config.launcher.nnodes * config.launcher.nproc_per_node


def expert_tensor_size(config: SaoConfig) -> int:
    p = config.parallelism
    return p.expert_tensor if p.expert_tensor is not None else p.tensor


def sequence_parallel_enabled(config: SaoConfig) -> bool:
    p = config.parallelism
    return p.sequence_parallel if p.sequence_parallel is not None else p.tensor > 1


def data_parallel_size(config: SaoConfig) -> int:
    p = config.parallelism
    return trainer_world_size(config) // (p.tensor * p.pipeline * p.context)


def _check(ok: bool, message: str, source: str) -> None:
    if not ok:
        raise ConfigError(f"{message} (in {source})")


def validate_config(config: SaoConfig, source: str = "config") -> None:
    """Raise ConfigError naming the offending keys for any impossible combination."""
    p, a = config.parallelism, config.algorithm
    etp = expert_tensor_size(config)
    world = trainer_world_size(config)
    _check(world >= 1, f"trainer world size must be >= 1, got {world}", source)
    dense = p.tensor * p.pipeline * p.context
    _check(
        world % dense == 0,
        f"parallelism.tensor x parallelism.pipeline x parallelism.context = {p.tensor} x {p.pipeline} x "
        f"{p.context} = {dense} does not divide the trainer world size {world} "
        "(parallelism.world_size, or launcher.nnodes x launcher.nproc_per_node)",
        source,
    )
    experts = etp * p.expert * p.pipeline
    _check(
        world % experts == 0,
        f"parallelism.expert_tensor x parallelism.expert x parallelism.pipeline = {etp} x {p.expert} x "
        f"{p.pipeline} = {experts} does not divide the trainer world size {world}",
        source,
    )
    if p.tensor > 1 and p.sequence_parallel is False:
        raise ConfigError(
            "parallelism.sequence_parallel=false with parallelism.tensor > 1: Megatron MoE layers need "
            f"sequence parallelism when tensor parallel (in {source})"
        )
    if p.virtual_pipeline is not None:
        _check(p.pipeline > 1, "parallelism.virtual_pipeline needs parallelism.pipeline > 1", source)

    if a.advantage == "grpo":
        _check(a.group_size >= 2, "algorithm.advantage=grpo needs algorithm.group_size >= 2", source)

    for role_name, role in (("actor", config.actor), ("critic", config.critic)):
        for list_name in ("trainable", "frozen"):
            for i, group in enumerate(getattr(role, list_name)):
                if group.startswith("re:"):
                    import re

                    try:
                        re.compile(group[3:])
                    except re.error as e:
                        raise ConfigError(f"{role_name}.{list_name}[{i}]: bad regex {group[3:]!r}: {e} "
                                          f"(in {source})") from e
                elif group not in PARAM_GROUPS:
                    raise ConfigError(
                        f"{role_name}.{list_name}[{i}]: unknown parameter group {group!r}; valid: "
                        f"{', '.join(PARAM_GROUPS)} or re:<regex> (in {source})"
                    )

    _check(config.actor.num_mini_batches <= config.data.batch_size, f"actor.num_mini_batches="
           f"{config.actor.num_mini_batches} exceeds data.batch_size={config.data.batch_size}", source)
    r = config.rollout
    # The trainer divides its logits by the engine's temperature, but the engine reports log-probs
    # of the unfiltered distribution while sampling from the filtered one: DIS's ratio would then
    # compare a distribution that was not sampled from.
    if a.policy_loss == "dis" and (r.top_p < 1.0 or r.top_k > 0):
        raise ConfigError(f"algorithm.policy_loss=dis needs unfiltered sampling: rollout.top_p={r.top_p} and "
                          f"rollout.top_k={r.top_k} change the sampling distribution but not the log-probs the "
                          f"engine reports; set rollout.top_p=1.0 rollout.top_k=-1 (in {source})")
    _check_rollout_names(config, source)
    if r.source == "recorded":
        _check(bool(config.data.trajectories_path), "rollout.source=recorded needs data.trajectories_path", source)
    if config.model.build_tiny:
        _check(bool(config.model.hf_path), "model.build_tiny needs model.hf_path (where to build it)", source)


def _check_rollout_names(config: SaoConfig, source: str) -> None:
    """Environment and reward names must be registered (or import paths `module:attribute`): the
    names are declared in `config/rollout_names.py`, which the rollout registries keep equal."""
    check_rollout_name("rollout.environment", config.rollout.environment, source)
    check_rollout_name("rollout.reward", config.rollout.reward, source)


def validate_against_model(config: SaoConfig, arch: dict[str, Any], source: str = "config") -> None:
    """Checks that need the model's architecture (`arch`: layers, heads, query groups, experts)."""
    p = config.parallelism
    etp = expert_tensor_size(config)
    checks = [
        ("num_attention_heads", p.tensor, "parallelism.tensor"),
        ("num_query_groups", p.tensor, "parallelism.tensor"),
        ("num_experts", p.expert, "parallelism.expert"),
        ("num_layers", p.pipeline * (p.virtual_pipeline or 1), "parallelism.pipeline x virtual_pipeline"),
        ("moe_ffn_hidden_size", etp, "parallelism.expert_tensor"),
    ]
    if p.expert > 1 and not arch.get("num_experts"):
        raise ConfigError(f"parallelism.expert = {p.expert} but the model has no experts (a dense model, in "
                          f"{source}): expert parallelism splits MoE experts; set parallelism.expert=1")
    for field, divisor, key in checks:
        value = arch.get(field)
        if value is not None and value % divisor != 0:
            raise ConfigError(f"{key} = {divisor} does not divide the model's {field} = {value} (in {source})")
