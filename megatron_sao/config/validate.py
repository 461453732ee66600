"""Cross-field checks: combinations that would fail (or silently misbehave) later are rejected
before anything starts. Field types are already checked by the loader."""

from __future__ import annotations

from typing import Any

from megatron_sao.config.loader import ConfigError
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
    p, a, c = config.parallelism, config.algorithm, config.critic
    for name in ("tensor", "pipeline", "expert", "context"):
        _check(getattr(p, name) >= 1, f"parallelism.{name} must be >= 1, got {getattr(p, name)}", source)
    etp = expert_tensor_size(config)
    _check(etp >= 1, f"parallelism.expert_tensor must be >= 1, got {etp}", source)
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

    _check(0.0 < a.eps_low < 1.0, f"algorithm.eps_low must be in (0, 1), got {a.eps_low}", source)
    _check(a.eps_high > 0.0, f"algorithm.eps_high must be > 0, got {a.eps_high}", source)
    _check(0.0 <= a.clip_low < 1.0, f"algorithm.clip_low must be in [0, 1), got {a.clip_low}", source)
    _check(a.clip_high >= 0.0, f"algorithm.clip_high must be >= 0, got {a.clip_high}", source)
    _check(0.0 < a.gamma <= 1.0, f"algorithm.gamma must be in (0, 1], got {a.gamma}", source)
    if a.lambda_policy is not None:
        _check(0.0 <= a.lambda_policy <= 1.0, f"algorithm.lambda_policy must be in [0, 1], got "
               f"{a.lambda_policy}", source)
    _check(0.0 <= a.lambda_critic <= 1.0, f"algorithm.lambda_critic must be in [0, 1], got "
           f"{a.lambda_critic}", source)
    _check(a.lambda_alpha > 0.0, f"algorithm.lambda_alpha must be > 0, got {a.lambda_alpha}", source)
    _check(a.group_size >= 1, f"algorithm.group_size must be >= 1, got {a.group_size}", source)
    if a.advantage == "grpo":
        _check(a.group_size >= 2, "algorithm.advantage=grpo needs algorithm.group_size >= 2", source)
    _check(a.max_staleness >= 0, f"algorithm.max_staleness must be >= 0, got {a.max_staleness}", source)
    _check(a.running_mean_window >= 1, "algorithm.running_mean_window must be >= 1", source)

    _check(c.updates_per_actor_step >= 1, "critic.updates_per_actor_step must be >= 1, got "
           f"{c.updates_per_actor_step}", source)
    _check(c.warmup_steps >= 0, f"critic.warmup_steps must be >= 0, got {c.warmup_steps}", source)
    for role_name, role in (("actor", config.actor), ("critic", config.critic)):
        _check(role.optim.lr >= 0, f"{role_name}.optim.lr must be >= 0", source)
        _check(role.micro_batch_size >= 1, f"{role_name}.micro_batch_size must be >= 1", source)
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

    for role_name, role in (("actor", config.actor), ("critic", config.critic)):
        if role.max_tokens_per_micro_batch is not None:
            _check(role.max_tokens_per_micro_batch >= 1, f"{role_name}.max_tokens_per_micro_batch must be >= 1 "
                   "or null", source)
    _check(config.actor.num_mini_batches >= 1, "actor.num_mini_batches must be >= 1", source)
    _check(config.actor.num_mini_batches <= config.data.batch_size, f"actor.num_mini_batches="
           f"{config.actor.num_mini_batches} exceeds data.batch_size={config.data.batch_size}", source)
    _check(config.run.max_consecutive_skipped_steps >= 1, "run.max_consecutive_skipped_steps must be >= 1", source)
    r = config.rollout
    _check(r.temperature > 0, f"rollout.temperature must be > 0, got {r.temperature}", source)
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
    _check(config.data.batch_size >= 1, "data.batch_size must be >= 1", source)
    _check(config.run.total_steps >= 0, "run.total_steps must be >= 0", source)
    _check(config.rollout.num_engines >= 1, "rollout.num_engines must be >= 1", source)
    _check(config.rollout.max_turns >= 1, "rollout.max_turns must be >= 1", source)
    _check(0.0 < config.rollout.top_p <= 1.0, "rollout.top_p must be in (0, 1]", source)
    if config.model.build_tiny:
        _check(bool(config.model.hf_path), "model.build_tiny needs model.hf_path (where to build it)", source)


def _check_rollout_names(config: SaoConfig, source: str) -> None:
    """Environment and reward names must be registered (or import paths `module:attribute`).

    The registries are read lazily from the rollout package: they are plain name tables (importing
    them loads no environment), and a name checked here cannot fail an hour into a run."""
    from megatron_sao.rollout.envs.registry import registered_environments
    from megatron_sao.rollout.rewards.registry import registered_rewards

    r = config.rollout
    for key, name, valid in (("rollout.environment", r.environment, registered_environments()),
                             ("rollout.reward", r.reward, registered_rewards())):
        if name not in valid and ":" not in name:
            raise ConfigError(f"{key}: unknown name {name!r}; registered: {', '.join(valid)}, or an import path "
                              f"'module:attribute' (in {source})")


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
