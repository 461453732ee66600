"""Rollout: trajectories, engines and the agent loop (knows nothing of Megatron).

| module | what |
|---|---|
| `environment` | the Environment interface (PromptSample, StepResult) |
| `trajectory`, `trajectory_io`, `trajectory_batch` | the trajectory record, Parquet / JSONL, padded tensors |
| `client`, `engine_pool`, `weight_transfer` | SGLang-protocol client, routing over engines, weight payloads |
| `launcher` | start / watch / restart SGLang (GPU) or CPU engine servers |
| `cpu_engine` | the old command `python -m megatron_sao.rollout.cpu_engine`; the engine is `megatron_sao.cpu_engine` |
| `chat_format`, `agent_loop` | token-in / token-out chat rendering, the async multi-turn loop |

The common names are importable from here; they load on first use so that light users of the
package (sandbox workers) do not import torch or httpx.
"""

from __future__ import annotations

from megatron_sao.utils.lazy_exports import lazy_getattr

_EXPORTS = {
    "Environment": "environment",
    "PromptSample": "environment",
    "StepResult": "environment",
    "Trajectory": "trajectory",
    "TrajectoryStatus": "trajectory",
    "RewardKind": "trajectory",
    "FinishType": "trajectory",
    "Turn": "trajectory",
    "Reward": "trajectory",
    "TrajectoryBatch": "trajectory_batch",
    "collate_trajectories": "trajectory_batch",
    "read_jsonl": "trajectory_io",
    "write_jsonl": "trajectory_io",
    "read_parquet": "trajectory_io",
    "write_parquet": "trajectory_io",
    "EngineClient": "client",
    "EngineError": "client",
    "EngineUnavailableError": "client",
    "GenerateOutput": "client",
    "SamplingParams": "client",
    "EnginePool": "engine_pool",
    "EngineConfig": "engine_supervisor",
    "EngineSupervisor": "engine_supervisor",
    "ChatFormat": "chat_format",
    "AgentLoop": "agent_loop",
    "AgentLoopConfig": "agent_loop",
    "AgentLoopStats": "agent_loop",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
