"""Pluggable reward functions: answer checkers, a remote reward model, a registry, and the
`SafeReward` wrapper that turns any failure into a counted, logged `RewardOutcome`."""

from megatron_sao.rollout.rewards.answers import (
    answers_equivalent,
    exact_match,
    extract_boxed,
    math_equivalence,
    normalize_answer,
    sympy_equivalent,
)
from megatron_sao.rollout.rewards.base import (
    REWARD_ERROR_KEY,
    RewardFn,
    RewardInput,
    RewardOutcome,
    RewardStats,
    SafeReward,
)
from megatron_sao.rollout.rewards.registry import register_reward, registered_rewards, resolve_reward
from megatron_sao.rollout.rewards.remote import RemoteRewardError, RemoteRewardModel

__all__ = [
    "REWARD_ERROR_KEY",
    "RemoteRewardError",
    "RemoteRewardModel",
    "RewardFn",
    "RewardInput",
    "RewardOutcome",
    "RewardStats",
    "SafeReward",
    "answers_equivalent",
    "exact_match",
    "extract_boxed",
    "math_equivalence",
    "normalize_answer",
    "register_reward",
    "registered_rewards",
    "resolve_reward",
    "sympy_equivalent",
]
