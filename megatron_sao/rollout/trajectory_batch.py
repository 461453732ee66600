"""Padded `[B, T]` tensors of a list of trajectories, as the trainer consumes them.

Shape legend: B trajectories, T padded length (the longest trajectory, rounded up to
`pad_to_multiple_of`). Trajectories are right-padded; padding has `attention_mask == False`,
`loss_mask == False`, log-prob 0, version -1 and reward 0, so every reduction over
`loss_mask` ignores it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_sao.rollout.trajectory import NO_POLICY_VERSION, Trajectory


@dataclass(slots=True)
class TrajectoryBatch:
    token_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] bool, True on real tokens
    loss_mask: torch.Tensor  # [B, T] bool, True on action tokens
    rollout_logprobs: torch.Tensor  # [B, T] float32 (or the requested dtype), 0 off-action
    policy_versions: torch.Tensor  # [B, T] int64, -1 off-action
    rewards: torch.Tensor  # [B, T] float32, each reward at its credited token (summed if several)
    lengths: torch.Tensor  # [B] int64
    prompt_lengths: torch.Tensor  # [B] int64
    prompt_ids: list[str]
    trajectory_ids: list[str]

    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]

    def to(self, device: torch.device | str) -> TrajectoryBatch:
        moved = {
            name: getattr(self, name).to(device)
            for name in (
                "token_ids",
                "attention_mask",
                "loss_mask",
                "rollout_logprobs",
                "policy_versions",
                "rewards",
                "lengths",
                "prompt_lengths",
            )
        }
        return TrajectoryBatch(**moved, prompt_ids=self.prompt_ids, trajectory_ids=self.trajectory_ids)


def collate_trajectories(
    trajectories: Sequence[Trajectory],
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    max_length: int | None = None,
    logprob_dtype: torch.dtype = torch.float32,
    reward_dtype: torch.dtype = torch.float32,
) -> TrajectoryBatch:
    """Stack `trajectories` into right-padded tensors.

    Raises ValueError if the list is empty, a trajectory is longer than `max_length`, or a
    trajectory breaks its invariants (each is validated: a bad record must not reach the loss).
    """
    if not trajectories:
        raise ValueError("collate_trajectories needs at least one trajectory")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    for traj in trajectories:
        traj.validate()
    longest = max(len(t) for t in trajectories)
    if max_length is not None and longest > max_length:
        raise ValueError(f"a trajectory has {longest} tokens, more than max_length={max_length}")
    T = -(-max(longest, 1) // pad_to_multiple_of) * pad_to_multiple_of
    B = len(trajectories)

    token_ids = torch.full((B, T), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((B, T), dtype=torch.bool)
    loss_mask = torch.zeros((B, T), dtype=torch.bool)
    rollout_logprobs = torch.zeros((B, T), dtype=torch.float64)
    policy_versions = torch.full((B, T), NO_POLICY_VERSION, dtype=torch.int64)
    rewards = torch.zeros((B, T), dtype=torch.float64)
    for b, traj in enumerate(trajectories):
        n = len(traj)
        token_ids[b, :n] = torch.tensor(traj.token_ids, dtype=torch.int64)
        attention_mask[b, :n] = True
        loss_mask[b, :n] = torch.tensor(traj.loss_mask, dtype=torch.bool)
        rollout_logprobs[b, :n] = torch.tensor(traj.rollout_logprobs, dtype=torch.float64)
        policy_versions[b, :n] = torch.tensor(traj.policy_versions, dtype=torch.int64)
        for reward in traj.rewards:
            rewards[b, reward.position] += reward.value
    return TrajectoryBatch(
        token_ids=token_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        rollout_logprobs=rollout_logprobs.to(logprob_dtype),
        policy_versions=policy_versions,
        rewards=rewards.to(reward_dtype),
        lengths=torch.tensor([len(t) for t in trajectories], dtype=torch.int64),
        prompt_lengths=torch.tensor([t.prompt_length for t in trajectories], dtype=torch.int64),
        prompt_ids=[t.prompt_id for t in trajectories],
        trajectory_ids=[t.trajectory_id for t in trajectories],
    )
