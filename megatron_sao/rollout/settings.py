"""The rollout package's own settings, derived from the run's config tree.

The rollout code takes small, self-contained dataclasses (`EngineConfig`, `AgentLoopConfig`) so it
can run without the rest of the project; a run describes rollout once, in `SaoConfig.rollout`.
These functions are the one place that maps one onto the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_sao.config.schema import RolloutConfig, SaoConfig
from megatron_sao.rollout.agent_loop import AgentLoopConfig
from megatron_sao.rollout.engine_supervisor import EngineConfig

# What each shipped environment takes from `SaoConfig.rollout` (its builder's keyword arguments);
# `rollout.environment_kwargs` overrides these.
_ENVIRONMENT_SETTINGS: dict[str, Callable[[RolloutConfig], dict[str, Any]]] = {
    "math_python": lambda r: {"reward": r.reward, "timeout_s": r.tool_timeout_s, "memory_mb": r.tool_memory_mb},
}


def engine_config_from(config: SaoConfig, model_path: str | None = None) -> EngineConfig:
    """Engine servers for `config` (SGLang on GPU, the CPU engine otherwise), serving `model_path`
    (default: the run's HF checkpoint).

    SGLang: `rollout.sglang.data` is DP attention (`--attn-dp-size`, one replica: 0.5.23 refuses
    tensor / distributed weight updates for `--dp-size` > 1); colocated engines get
    `--enable-memory-saver` (without it `release_memory_occupation` frees nothing); engines of a
    disaggregated run started outside Ray begin after the GPUs trainer ranks take on rank 0's node
    (`--base-gpu-id`; on Ray each engine host starts at the GPU Ray gave it)."""
    from megatron_sao.planning.placement import engine_placement, trainer_gpus_on_first_node

    rollout = config.rollout
    sglang = rollout.engine == "sglang"
    colocated = engine_placement(config) == "colocated"
    return EngineConfig(
        backend=rollout.engine,
        model_path=model_path or config.model.hf_path,
        num_engines=rollout.num_engines,
        random_seed=config.run.seed,
        tp_size=rollout.sglang.tensor,
        ep_size=rollout.sglang.expert,
        attn_dp_size=rollout.sglang.data,
        base_gpu_id=trainer_gpus_on_first_node(config) if sglang and not colocated else 0,
        enable_memory_saver=sglang and colocated,
        mem_fraction_static=rollout.sglang.mem_fraction_static,
        context_length=rollout.max_total_tokens,
        extra_args=list(rollout.sglang.extra_args),
    )


def agent_loop_config_from(config: SaoConfig) -> AgentLoopConfig:
    """Turn / token limits, sampling and concurrency of the agent loop for `config`."""
    rollout = config.rollout
    return AgentLoopConfig(
        max_turns=rollout.max_turns,
        max_total_tokens=rollout.max_total_tokens,
        max_new_tokens_per_turn=rollout.max_new_tokens_per_turn,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_concurrent_trajectories=rollout.num_engines * rollout.max_inflight_per_engine,
    )


def environment_kwargs_from(config: SaoConfig) -> dict[str, Any]:
    """Keyword arguments of the environment's builder: derived settings, then the recipe's
    `rollout.environment_kwargs` on top."""
    rollout = config.rollout
    derived = _ENVIRONMENT_SETTINGS.get(rollout.environment, lambda r: {})(rollout)
    return {**derived, **rollout.environment_kwargs}


def env_factory_from(config: SaoConfig) -> Any:
    """The per-trajectory environment factory of `config`."""
    from megatron_sao.rollout.envs import make_env_factory

    return make_env_factory(config.rollout.environment, **environment_kwargs_from(config))
