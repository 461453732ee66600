"""Range checks of single numeric fields, and names that become paths: every such check of the
configuration lives here (`RANGES`).

The loader already refuses non-finite numbers (NaN, inf) for every float field; this table says
which values each field may take, so a recipe cannot ask for a NaN temperature, a negative
learning rate or zero tokens per turn and fail (or silently misbehave) an hour later. Cross-field
combinations stay in `validate.py`. Each message names the key and where its value came from:
`sources` maps a dotted key to its recipe file or "command line" (the loader passes it); a plain
string is used for every key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from megatron_sao.config.errors import ConfigError
from megatron_sao.config.schema import SaoConfig

Check = tuple[Callable[[Any], bool], str]

_POSITIVE: Check = (lambda v: v > 0, "> 0")
_NON_NEGATIVE: Check = (lambda v: v >= 0, ">= 0")
_AT_LEAST_ONE: Check = (lambda v: v >= 1, ">= 1")
_FRACTION_OPEN: Check = (lambda v: 0.0 <= v < 1.0, "in [0, 1)")
_FRACTION_HALF_OPEN: Check = (lambda v: 0.0 < v <= 1.0, "in (0, 1]")
_FRACTION_OPEN_BOTH: Check = (lambda v: 0.0 < v < 1.0, "in (0, 1)")
_FRACTION_CLOSED: Check = (lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
_TOP_K: Check = (lambda v: v == -1 or v >= 1, "-1 (no top-k) or >= 1")

_OPTIM = {
    "lr": _NON_NEGATIVE,
    "min_lr": _NON_NEGATIVE,
    "lr_warmup_steps": _NON_NEGATIVE,
    "weight_decay": _NON_NEGATIVE,
    "adam_beta1": _FRACTION_OPEN,
    "adam_beta2": _FRACTION_OPEN,
    "adam_eps": _POSITIVE,
    "clip_grad": _NON_NEGATIVE,
}
_ROLE = {"micro_batch_size": _AT_LEAST_ONE, "max_tokens_per_micro_batch": _AT_LEAST_ONE}

RANGES: dict[str, Check] = {
    "run.seed": _NON_NEGATIVE,
    "run.total_steps": _NON_NEGATIVE,
    "run.max_consecutive_skipped_steps": _AT_LEAST_ONE,
    **{f"model.{k}": _AT_LEAST_ONE for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                                             "num_experts", "moe_router_topk", "moe_ffn_hidden_size")},
    "model.moe_aux_loss_coeff": _NON_NEGATIVE,
    "parallelism.world_size": _AT_LEAST_ONE,
    **{f"parallelism.{k}": _AT_LEAST_ONE for k in ("tensor", "pipeline", "expert", "context", "expert_tensor")},
    **{f"{role}.optim.{k}": c for role in ("actor", "critic") for k, c in _OPTIM.items()},
    **{f"{role}.{k}": c for role in ("actor", "critic") for k, c in _ROLE.items()},
    "actor.num_mini_batches": _AT_LEAST_ONE,
    "actor.logits_chunk_tokens": _AT_LEAST_ONE,
    "critic.value_clip": _POSITIVE,
    "critic.value_head_init_std": _POSITIVE,
    "critic.updates_per_actor_step": _AT_LEAST_ONE,
    "critic.warmup_steps": _NON_NEGATIVE,
    "critic.ev_min_return_var": _NON_NEGATIVE,
    "algorithm.eps_low": _FRACTION_OPEN_BOTH,
    "algorithm.eps_high": _POSITIVE,
    "algorithm.clip_low": _FRACTION_OPEN,
    "algorithm.clip_high": _NON_NEGATIVE,
    "algorithm.gamma": _FRACTION_HALF_OPEN,
    "algorithm.lambda_policy": _FRACTION_CLOSED,
    "algorithm.lambda_critic": _FRACTION_CLOSED,
    "algorithm.lambda_alpha": _POSITIVE,
    "algorithm.group_size": _AT_LEAST_ONE,
    "algorithm.max_staleness": _NON_NEGATIVE,
    "algorithm.running_mean_window": _AT_LEAST_ONE,
    "rollout.num_engines": _AT_LEAST_ONE,
    "rollout.sglang.tensor": _AT_LEAST_ONE,
    "rollout.sglang.expert": _AT_LEAST_ONE,
    "rollout.sglang.data": _AT_LEAST_ONE,
    "rollout.sglang.mem_fraction_static": _FRACTION_HALF_OPEN,
    "rollout.temperature": _POSITIVE,
    "rollout.top_p": _FRACTION_HALF_OPEN,
    "rollout.top_k": _TOP_K,
    "rollout.max_turns": _AT_LEAST_ONE,
    "rollout.max_new_tokens_per_turn": _AT_LEAST_ONE,
    "rollout.max_total_tokens": _AT_LEAST_ONE,
    "rollout.max_inflight_per_engine": _AT_LEAST_ONE,
    "rollout.tool_timeout_s": _POSITIVE,
    "rollout.tool_memory_mb": _AT_LEAST_ONE,
    "data.max_prompt_chars": _AT_LEAST_ONE,
    "data.batch_size": _AT_LEAST_ONE,
    "eval.every_n_steps": _NON_NEGATIVE,
    "eval.num_prompts": _AT_LEAST_ONE,
    "logging.log_every": _AT_LEAST_ONE,
    "logging.progress_interval_s": _NON_NEGATIVE,
    "checkpoint.save_every": _NON_NEGATIVE,
    "checkpoint.keep_last": _AT_LEAST_ONE,
    "launcher.nnodes": _AT_LEAST_ONE,
    "launcher.nproc_per_node": _AT_LEAST_ONE,
}
"""dotted key -> (predicate, what it requires). None values (optional fields) are not checked."""

NAME_KEYS = ("run.name",)
"""Names that become one path component (the run directory `run.output_dir/run.name`)."""


def _source(sources: str | Mapping[str, str], key: str) -> str:
    if isinstance(sources, str):
        return sources
    return sources.get(key, "defaults")


def _get(config: SaoConfig, key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def validate_numbers(config: SaoConfig, source: str | Mapping[str, str]) -> None:
    """Raise ConfigError for the first numeric field outside its range (or not finite), naming
    the key, the value and where it came from."""
    for key, (ok, requirement) in RANGES.items():
        value = _get(config, key)
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value} (from {_source(source, key)})")
        if not ok(value):
            raise ConfigError(f"{key} must be {requirement}, got {value} (from {_source(source, key)})")
    rollout = config.rollout
    if rollout.max_new_tokens_per_turn > rollout.max_total_tokens:
        raise ConfigError(
            f"rollout.max_new_tokens_per_turn ({rollout.max_new_tokens_per_turn}) exceeds rollout.max_total_tokens "
            f"({rollout.max_total_tokens}) (from {_source(source, 'rollout.max_new_tokens_per_turn')})")
    for role in ("actor", "critic"):
        optim = getattr(config, role).optim
        if optim.min_lr > optim.lr:
            raise ConfigError(f"{role}.optim.min_lr ({optim.min_lr}) exceeds {role}.optim.lr ({optim.lr}) "
                              f"(from {_source(source, f'{role}.optim.min_lr')})")


def validate_names(config: SaoConfig, source: str | Mapping[str, str]) -> None:
    """A name that becomes a path component must stay one: no separators, no `.` / `..`, not
    empty, no control characters (so `run.name=../../x` cannot escape `run.output_dir`)."""
    for key in NAME_KEYS:
        name = _get(config, key)
        bad = (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
               or any(ord(c) < 32 for c in name) or name != name.strip())
        if bad:
            raise ConfigError(f"{key}={name!r} must be a plain name (one directory name: no '/', '\\', '.', '..', "
                              f"surrounding spaces or control characters) (from {_source(source, key)})")
