"""Training compute per SAO step: FLOPs and the time they take at an assumed MFU.

Per trained token a pass costs 2 x active parameters (matmuls) plus causal attention,
2 x layers x heads x (qk + v head dims) x context / 2. Backward is twice the forward; full
recompute adds one forward. A step trains the actor once and the critic K times
(`critic.updates_per_actor_step`) on the same batch, after one critic forward for the values;
`ppo_clip` with recomputed old log-probs adds an actor forward. Engine generation is not
counted (decoding is bound by memory bandwidth, not FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sao.config.schema import SaoConfig
from megatron_sao.planning.gpus import GpuSpec
from megatron_sao.planning.memory import uses_critic
from megatron_sao.planning.params import ModelCensus


@dataclass(frozen=True, slots=True)
class ComputeEstimate:
    tokens_per_step: int
    avg_tokens_per_trajectory: int
    step_pflop: float
    mfu: float
    step_seconds: float


def estimate_compute(config: SaoConfig, census: ModelCensus, gpu: GpuSpec, trainer_gpus: int,
                     avg_tokens: int | None = None, mfu: float = 0.3) -> ComputeEstimate:
    """FLOPs of one step and its time on `trainer_gpus` GPUs at `mfu` of the bf16 peak."""
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {mfu}")
    avg = avg_tokens or config.rollout.max_total_tokens // 2
    tokens = config.data.batch_size * config.algorithm.group_size * avg
    attention = 2 * census.num_layers * census.num_heads * (census.qk_head_dim + census.v_head_dim) * avg / 2
    passes_per_update = 4 if config.model.recompute_granularity == "full" else 3
    actor_forward = 2 * census.params_active + attention
    critic_forward = 2 * census.critic_active + attention
    flops = actor_forward * passes_per_update
    if uses_critic(config):
        flops += critic_forward * (1 + passes_per_update * config.critic.updates_per_actor_step)
    if config.algorithm.policy_loss == "ppo_clip" and config.algorithm.old_logprobs == "recompute":
        flops += actor_forward
    flops *= tokens
    seconds = flops / (trainer_gpus * gpu.bf16_tflops * 1e12 * mfu)
    return ComputeEstimate(tokens, avg, flops / 1e15, mfu, seconds)
