"""Advantage estimators of the ablations (SAO section 5), same `[B, T]` conventions as GAE.

- `grpo_advantages`: group-normalised reward (GRPO, 16 prompts x 8 in the paper), broadcast to
  the action tokens of each trajectory;
- `RunningMeanBaseline`: reward minus the mean of the last N rewards, per prompt (paper math
  ablation: 8) or global (paper online-learning run: 128), for single-rollout runs without critic;
- `step_level_advantages`: GAE over turns instead of tokens, a turn's value being the average or
  the last of its token values, the turn's advantage broadcast to its tokens (paper appendix).

Legend: B trajectories, T tokens, N turns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any, Literal

import torch

from megatron_sao.algo._checks import FLOAT_DTYPES, check_like_mask, check_mask
from megatron_sao.algo.gae import skip_observation_gae


def _check_per_trajectory(tensor: torch.Tensor, name: str, loss_mask: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.shape != loss_mask.shape[:1]:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a [B] = [{loss_mask.shape[0]}] tensor, got {shape}")
    if tensor.device != loss_mask.device:
        raise ValueError(f"{name} is on {tensor.device} but loss_mask is on {loss_mask.device}")


def broadcast_to_tokens(per_trajectory: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """`[B]` -> `[B, T]`: each trajectory's value on its action tokens, 0 elsewhere."""
    check_mask(loss_mask)
    _check_per_trajectory(per_trajectory, "per_trajectory", loss_mask)
    return torch.where(loss_mask, per_trajectory[:, None], 0.0).to(per_trajectory.dtype)


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, loss_mask: torch.Tensor,
                    normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage `(r - mean_group) / (std_group + eps)`, broadcast to action tokens.

    Args:
        rewards: float `[B]` trajectory rewards.
        group_ids: integer `[B]`; trajectories with equal ids (same prompt) form a group, in any
            order (`torch.arange(B) // G` for contiguous groups of G).
        loss_mask: bool `[B, T]`.
        normalize_std: divide by the group's standard deviation (Bessel-corrected, as in verl
            and TRL); False gives Dr. GRPO's mean-only baseline.
        eps: added to the std, so that a group whose rewards are all equal gets advantage 0.

    Returns:
        `[B, T]` in the rewards' dtype. A group of one trajectory has advantage 0.
    """
    check_mask(loss_mask)
    _check_per_trajectory(rewards, "rewards", loss_mask)
    _check_per_trajectory(group_ids, "group_ids", loss_mask)
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be floating point, got {rewards.dtype}")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not eps >= 0:
        raise ValueError(f"eps must be non-negative, got {eps}")
    if rewards.numel() == 0:
        return torch.zeros(loss_mask.shape, dtype=rewards.dtype, device=rewards.device)
    _, group_b = torch.unique(group_ids, return_inverse=True)
    reward_b = rewards.detach().to(torch.float64)
    count_g = torch.bincount(group_b).to(torch.float64)
    mean_g = torch.bincount(group_b, weights=reward_b) / count_g
    centred_b = reward_b - mean_g[group_b]
    if normalize_std:
        var_g = torch.bincount(group_b, weights=centred_b.square()) / (count_g - 1.0).clamp_min(1.0)
        centred_b = centred_b / (var_g.sqrt()[group_b] + eps)
    return broadcast_to_tokens(centred_b.to(rewards.dtype), loss_mask)


class RunningMeanBaseline:
    """Advantage `r - mean(last `window` rewards)`, per prompt or over all prompts.

    Every trajectory of a batch is scored against the windows as they were before the batch, then
    the batch's rewards enter the windows in batch order (so two trajectories of one prompt in
    the same batch share a baseline). An empty window has baseline `initial`. `state_dict()`
    carries the windows across a resume.
    """

    def __init__(self, window: int, scope: Literal["prompt", "global"] = "prompt",
                 initial: float = 0.0) -> None:
        if int(window) < 1:
            raise ValueError(f"window must be a positive integer, got {window}")
        if scope not in ("prompt", "global"):
            raise ValueError(f"scope must be 'prompt' or 'global', got {scope!r}")
        self.window = int(window)
        self.scope = scope
        self.initial = float(initial)
        self._history: dict[Hashable, deque[float]] = {}

    def baseline(self, key: Hashable) -> float:
        """Current mean of the window of `key` (`initial` if empty)."""
        history = self._history.get(key if self.scope == "prompt" else None)
        return sum(history) / len(history) if history else self.initial

    def advantages(self, rewards: torch.Tensor, prompt_ids: Sequence[Hashable] | torch.Tensor | None = None,
                   ) -> torch.Tensor:
        """`[B]` advantages of a batch (per trajectory; `broadcast_to_tokens` spreads them)."""
        if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or not rewards.is_floating_point():
            raise ValueError("rewards must be a floating-point [B] tensor")
        if self.scope == "prompt":
            if prompt_ids is None:
                raise ValueError("prompt_ids is required when scope='prompt'")
            keys = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
            if len(keys) != rewards.shape[0]:
                raise ValueError(f"prompt_ids has {len(keys)} entries for {rewards.shape[0]} rewards")
        else:
            keys = [None] * rewards.shape[0]
        baseline_b = torch.tensor([self.baseline(k) for k in keys], dtype=torch.float64)
        for key, reward in zip(keys, rewards.detach().to(torch.float64).tolist(), strict=True):
            self._history.setdefault(key, deque(maxlen=self.window)).append(reward)
        return (rewards.detach().to(torch.float64) - baseline_b.to(rewards.device)).to(rewards.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "scope": self.scope, "initial": self.initial,
                "history": {k: list(v) for k, v in self._history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["window"] != self.window or state["scope"] != self.scope:
            raise ValueError(f"state is for window={state['window']} scope={state['scope']!r}, this "
                             f"baseline has window={self.window} scope={self.scope!r}")
        self.initial = float(state["initial"])
        self._history = {k: deque(v, maxlen=self.window) for k, v in state["history"].items()}


def step_level_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
    mode: Literal["average", "last"] = "average",
    turn_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over turns, each turn's advantage and return broadcast to its action tokens.

    A turn is a maximal run of consecutive action tokens (with `turn_ids`, an integer `[B, T]`
    label read on action tokens, a run also ends where the label changes). Its value is the
    average (`mode="average"`) or the last (`mode="last"`) of its token values; its reward is the
    sum of the rewards its tokens are credited with under `skip_observation_gae`'s rule (rewards
    up to the next turn's first token; none before the first turn). Then
    `skip_observation_gae` runs on the `[B, N]` turn sequence with `gamma` and `lam` per turn
    (`length_adaptive_lambda` of the turn counts is the analogue of the token-level lambda).

    Returns `(advantages, returns)`, `[B, T]` in the input dtype, 0 off action tokens; returns are
    the turn's `A + V`, constant over the turn.
    """
    check_mask(loss_mask)
    check_like_mask(rewards, "rewards", loss_mask, dtypes=FLOAT_DTYPES)
    check_like_mask(values, "values", loss_mask, dtypes=(rewards.dtype,))
    if mode not in ("average", "last"):
        raise ValueError(f"mode must be 'average' or 'last', got {mode!r}")
    batch, num_tokens = loss_mask.shape
    prev_action = torch.nn.functional.pad(loss_mask[:, :-1], (1, 0))
    start_bt = loss_mask & ~prev_action
    if turn_ids is not None:
        check_like_mask(turn_ids, "turn_ids", loss_mask, dtypes=(torch.int32, torch.int64))
        prev_id = torch.nn.functional.pad(turn_ids[:, :-1], (1, 0))
        start_bt |= loss_mask & (turn_ids != prev_id)
    next_start = torch.nn.functional.pad(start_bt[:, 1:], (0, 1))
    next_action = torch.nn.functional.pad(loss_mask[:, 1:], (0, 1))
    end_bt = loss_mask & (~next_action | next_start)

    # turn_bt: index of the latest turn started at or before t (-1 before the first); column N
    # of the [B, N + 1] accumulators collects what precedes the first turn and is dropped.
    turn_bt = torch.cumsum(start_bt, dim=1) - 1
    num_turns = int(start_bt.sum(dim=1).max()) if batch and num_tokens else 0
    if num_turns == 0:
        return torch.zeros_like(rewards), torch.zeros_like(rewards)
    slot_bt = torch.where(turn_bt >= 0, turn_bt, num_turns)
    f64 = torch.float64
    turn_reward = torch.zeros(batch, num_turns + 1, dtype=f64, device=loss_mask.device)
    turn_reward.scatter_add_(1, slot_bt, rewards.to(f64))
    turn_value = torch.zeros_like(turn_reward)
    if mode == "average":
        turn_value.scatter_add_(1, slot_bt, torch.where(loss_mask, values.to(f64), 0.0))
        count = torch.zeros_like(turn_reward).scatter_add_(1, slot_bt, loss_mask.to(f64))
        turn_value = turn_value / count.clamp_min(1.0)
    else:
        turn_value.scatter_add_(1, slot_bt, torch.where(end_bt, values.to(f64), 0.0))
    turn_mask = torch.arange(num_turns, device=loss_mask.device)[None, :] < start_bt.sum(dim=1)[:, None]
    adv_bn, ret_bn = skip_observation_gae(turn_reward[:, :num_turns], turn_value[:, :num_turns], turn_mask,
                                          gamma=gamma, lam=lam)
    index_bt = turn_bt.clamp(0, num_turns - 1)
    adv = torch.where(loss_mask, adv_bn.gather(1, index_bt), 0.0).to(rewards.dtype)
    ret = torch.where(loss_mask, ret_bn.gather(1, index_bt), 0.0).to(rewards.dtype)
    return adv, ret
