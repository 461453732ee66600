"""The rollout package's own settings, derived from the run's config tree.

The rollout code takes small, self-contained dataclasses (`EngineConfig`, `AgentLoopConfig`) so it
can run without the rest of the project; a run describes rollout once, in `SaoConfig.rollout`.
These functions are the one place that maps one onto the other.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_sao.config.schema import RolloutConfig, SaoConfig
from megatron_sao.rollout.agent_loop import AgentLoopConfig
from megatron_sao.rollout.engine_supervisor import EngineConfig
from megatron_sao.rollout.routing import RoutingSpec, routing_spec_from_hf_config

# What each shipped environment takes from `SaoConfig.rollout` (its builder's keyword arguments);
# `rollout.environment_kwargs` overrides these.
_ENVIRONMENT_SETTINGS: dict[str, Callable[[RolloutConfig], dict[str, Any]]] = {
    "math_python": lambda r: {"reward": r.reward, "timeout_s": r.tool_timeout_s, "memory_mb": r.tool_memory_mb},
}


def engine_config_from(config: SaoConfig, model_path: str | None = None, routing: bool = True) -> EngineConfig:
    """Engine servers for `config` (SGLang on GPU, the CPU engine otherwise), serving `model_path`
    (default: the run's HF checkpoint); returning routed experts when the run replays routing,
    unless `routing` is False (rollouts no actor trains on: evaluation, value pretraining).

    SGLang: `rollout.sglang.data` is DP attention (`--attn-dp-size`, one replica: 0.5.23 refuses
    tensor / distributed weight updates for `--dp-size` > 1); colocated engines get
    `--enable-memory-saver` (without it `release_memory_occupation` frees nothing); engines of a
    disaggregated run started outside Ray begin after the GPUs trainer ranks take on rank 0's node
    (`--base-gpu-id`; on Ray each engine host starts at the GPU Ray gave it)."""
    from megatron_sao.config.placement import engine_placement, trainer_gpus_on_first_node

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
        return_routed_experts=routing and replay_routing_spec(config) is not None,
    )


def agent_loop_config_from(config: SaoConfig, routing: bool = True) -> AgentLoopConfig:
    """Turn / token limits, sampling and concurrency of the agent loop for `config`; recording
    routed experts when the run replays routing, unless `routing` is False."""
    rollout = config.rollout
    return AgentLoopConfig(
        max_turns=rollout.max_turns,
        max_total_tokens=rollout.max_total_tokens,
        max_new_tokens_per_turn=rollout.max_new_tokens_per_turn,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_concurrent_trajectories=rollout.num_engines * rollout.max_inflight_per_engine,
        routing=replay_routing_spec(config) if routing else None,
    )


def model_routing_spec(config: SaoConfig) -> RoutingSpec | None:
    """The routing layout of the run's HF checkpoint (`model.hf_path/config.json`); None for a
    dense model."""
    path = Path(config.model.hf_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"model.hf_path={config.model.hf_path!r}: no config.json to read the MoE layout from")
    return routing_spec_from_hf_config(json.loads(path.read_text()))


def recorded_file_has_routing(path: str | Path) -> bool:
    """Whether a recorded trajectory file's records carry `routed_experts` (Parquet: any row of
    the column; JSONL: the first record)."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        if "routed_experts_topk" not in parquet.schema_arrow.names:
            return False
        column = parquet.read(columns=["routed_experts_topk"]).column(0)
        return column.null_count < len(column)
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    row = json.loads(raw)
                except ValueError:
                    continue
                return isinstance(row, dict) and row.get("routed_experts") is not None
    return False


def routing_replay_enabled(config: SaoConfig) -> bool:
    """`actor.routing_replay` resolved (see its docstring): an explicit value, or the default for
    the run's model and trajectory source."""
    if config.actor.routing_replay is not None:
        return config.actor.routing_replay
    if config.rollout.source != "engine":
        path = config.data.trajectories_path
        if not (path and Path(path).is_file() and recorded_file_has_routing(path)):
            return False
    return model_routing_spec(config) is not None


def replay_routing_spec(config: SaoConfig) -> RoutingSpec | None:
    """The model's routing layout when the run replays routing (engines must return it), else None."""
    if not routing_replay_enabled(config):
        return None
    spec = model_routing_spec(config)
    if spec is None:
        raise ValueError("actor.routing_replay=true needs an MoE model; model.hf_path has no MoE layer")
    return spec


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
