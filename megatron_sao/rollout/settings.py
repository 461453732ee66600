"""The rollout package's own settings, derived from the run's config tree.

The rollout code takes small, self-contained dataclasses (`EngineConfig`, `AgentLoopConfig`) so it
can run without the rest of the project; a run describes rollout once, in `SaoConfig.rollout`.
These functions are the one place that maps one onto the other.
"""

from __future__ import annotations

from megatron_sao.config.schema import SaoConfig
from megatron_sao.rollout.agent_loop import AgentLoopConfig
from megatron_sao.rollout.launcher import EngineConfig


def engine_config_from(config: SaoConfig, model_path: str | None = None) -> EngineConfig:
    """Engine servers for `config` (SGLang on GPU, the CPU engine otherwise), serving `model_path`
    (default: the run's HF checkpoint)."""
    rollout = config.rollout
    return EngineConfig(
        backend=rollout.engine,
        model_path=model_path or config.model.hf_path,
        num_engines=rollout.num_engines,
        random_seed=config.run.seed,
        tp_size=rollout.sglang.tensor,
        ep_size=rollout.sglang.expert,
        dp_size=rollout.sglang.data,
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
