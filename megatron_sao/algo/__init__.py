"""SAO algorithm core, pure torch: skip-observation GAE, DIS, critic loss, ablation baselines,
diagnostics. Tensors are `[B, T]` padded trajectories with a bool `loss_mask` (True on action
tokens). See docs/algorithm.md.
"""

from megatron_sao.algo.baselines import (
    RunningMeanBaseline,
    broadcast_to_tokens,
    grpo_advantages,
    step_level_advantages,
)
from megatron_sao.algo.diagnostics import (
    ATTENTION_MOE_PATTERNS,
    StalenessMaskCounts,
    grad_norm_by_group,
    grad_sq_norms_by_group,
    masked_fraction_by_staleness,
    staleness,
    staleness_histogram,
)
from megatron_sao.algo.dis import dis_policy_loss
from megatron_sao.algo.gae import length_adaptive_lambda, skip_observation_gae
from megatron_sao.algo.gae_reference import skip_observation_gae_reference
from megatron_sao.algo.ppo import ppo_clip_policy_loss
from megatron_sao.algo.value import (
    explained_variance,
    explained_variance_from_moments,
    explained_variance_moments,
    return_variance_from_moments,
    value_loss,
)

__all__ = [
    "ATTENTION_MOE_PATTERNS",
    "RunningMeanBaseline",
    "StalenessMaskCounts",
    "broadcast_to_tokens",
    "dis_policy_loss",
    "explained_variance",
    "explained_variance_from_moments",
    "explained_variance_moments",
    "grad_norm_by_group",
    "grad_sq_norms_by_group",
    "grpo_advantages",
    "length_adaptive_lambda",
    "masked_fraction_by_staleness",
    "ppo_clip_policy_loss",
    "return_variance_from_moments",
    "skip_observation_gae",
    "skip_observation_gae_reference",
    "staleness",
    "staleness_histogram",
    "step_level_advantages",
    "value_loss",
]
