"""Advantages and value targets of one batch, per the recipe's estimator (pure torch, via `algo`).

Two kinds of estimator:
  - critic-based (`gae`: SAO's skip-observation GAE; `step_level`: GAE over turns): need the
    critic's values V(s_t), so they are computed per micro-batch on the last pipeline stage;
  - trajectory-level (`grpo`, `running_mean`): one scalar per trajectory from the rewards of the
    whole batch, computed identically on every rank before the batch is split.
Value targets are always token-level skip-observation GAE returns with `lambda_critic`
(the critic regresses per token even when the actor's advantage is step-level).

Legend: B trajectories of a micro-batch, T its padded length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_sao.algo import (
    RunningMeanBaseline,
    grpo_advantages,
    length_adaptive_lambda,
    skip_observation_gae,
    step_level_advantages,
)
from megatron_sao.config.schema import AlgorithmConfig
from megatron_sao.rollout.trajectory import Trajectory

CRITIC_ESTIMATORS = ("gae", "step_level")


def needs_critic(algorithm: AlgorithmConfig) -> bool:
    return algorithm.advantage in CRITIC_ESTIMATORS


def policy_lambda(algorithm: AlgorithmConfig, num_action_tokens_b: torch.Tensor) -> float | torch.Tensor:
    """`lambda_policy`, or VAPO's length-adaptive `1 - 1 / (alpha * l)` per trajectory when unset."""
    if algorithm.lambda_policy is not None:
        return algorithm.lambda_policy
    return length_adaptive_lambda(num_action_tokens_b, alpha=algorithm.lambda_alpha)


def bootstrapped_rewards(rewards_bt: torch.Tensor, loss_mask_bt: torch.Tensor, end_values_b: torch.Tensor,
                         truncated_b: torch.Tensor, gamma: float) -> torch.Tensor:
    """Rewards with `gamma * V(s_end)` added at the last action token of truncated rows, so GAE
    bootstraps them from the critic instead of treating the cut as the end of the episode."""
    positions_bt = torch.arange(loss_mask_bt.shape[1], device=loss_mask_bt.device).expand_as(loss_mask_bt)
    last_action_b = torch.where(loss_mask_bt, positions_bt, -1).max(dim=1).values
    rows = truncated_b & (last_action_b >= 0)
    out = rewards_bt.clone()
    out[rows, last_action_b[rows]] += gamma * end_values_b[rows].to(out.dtype)
    return out


def critic_advantages(algorithm: AlgorithmConfig, rewards_bt: torch.Tensor, values_bt: torch.Tensor,
                      loss_mask_bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(advantages, returns)` `[B, T]` of a critic-based estimator for one micro-batch."""
    num_action_b = loss_mask_bt.sum(dim=1)
    _, returns_bt = skip_observation_gae(rewards_bt, values_bt, loss_mask_bt, gamma=algorithm.gamma,
                                         lam=algorithm.lambda_critic)
    if algorithm.advantage == "gae":
        advantages_bt, _ = skip_observation_gae(rewards_bt, values_bt, loss_mask_bt, gamma=algorithm.gamma,
                                                lam=policy_lambda(algorithm, num_action_b))
    elif algorithm.advantage == "step_level":
        turns_b = _num_turns(loss_mask_bt)
        lam = algorithm.lambda_policy if algorithm.lambda_policy is not None else length_adaptive_lambda(
            turns_b, alpha=algorithm.lambda_alpha)
        advantages_bt, _ = step_level_advantages(rewards_bt, values_bt, loss_mask_bt, gamma=algorithm.gamma, lam=lam,
                                                 mode=algorithm.step_level_mode)
    else:
        raise ValueError(f"algorithm.advantage={algorithm.advantage!r} is not critic-based")
    return advantages_bt, returns_bt


def _num_turns(loss_mask_bt: torch.Tensor) -> torch.Tensor:
    previous_bt = torch.nn.functional.pad(loss_mask_bt[:, :-1], (1, 0))
    return (loss_mask_bt & ~previous_bt).sum(dim=1)


def trajectory_advantages(algorithm: AlgorithmConfig, trajectories: Sequence[Trajectory],
                          baseline: RunningMeanBaseline | None) -> torch.Tensor:
    """float32 `[B]` per-trajectory advantages of `grpo` / `running_mean` over the whole batch
    (`running_mean` also records the batch's rewards in `baseline`)."""
    rewards_b = torch.tensor([t.total_reward for t in trajectories], dtype=torch.float64)
    if algorithm.advantage == "grpo":
        prompt_index: dict[str, int] = {}
        group_b = torch.tensor([prompt_index.setdefault(t.prompt_id, len(prompt_index)) for t in trajectories])
        ones_b1 = torch.ones(len(trajectories), 1, dtype=torch.bool)
        return grpo_advantages(rewards_b, group_b, ones_b1, normalize_std=algorithm.grpo_normalize_std)[:, 0].float()
    if algorithm.advantage == "running_mean":
        if baseline is None:
            raise ValueError("algorithm.advantage=running_mean needs a RunningMeanBaseline")
        return baseline.advantages(rewards_b, [t.prompt_id for t in trajectories]).float()
    raise ValueError(f"algorithm.advantage={algorithm.advantage!r} is not trajectory-level")


def make_baseline(algorithm: AlgorithmConfig) -> RunningMeanBaseline | None:
    if algorithm.advantage != "running_mean":
        return None
    return RunningMeanBaseline(window=algorithm.running_mean_window, scope=algorithm.running_mean_scope)


def normalize_advantage_rows(rows: dict[int, torch.Tensor], total: float, squares: float, count: float,
                             mode: str, eps: float = 1e-6) -> dict[int, torch.Tensor]:
    """`algorithm.advantage_norm` on a batch's advantage rows, given the sum, the sum of squares and
    the number of the batch's action-token advantages (over every micro-batch and rank): `mean`
    subtracts their mean, `whiten` also divides by their std. Positions off the action mask change
    too; the losses never read them."""
    if mode == "none" or count < 1:
        return rows
    if mode not in ("mean", "whiten"):
        raise ValueError(f"algorithm.advantage_norm={mode!r}: expected none, mean or whiten")
    mean = total / count
    scale = 1.0
    if mode == "whiten":
        scale = 1.0 / (max(squares / count - mean * mean, 0.0) ** 0.5 + eps)
    return {index: (row - mean) * scale for index, row in rows.items()}
