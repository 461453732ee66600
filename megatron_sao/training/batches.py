"""Trajectories -> the micro-batches Megatron's schedules consume, balanced across data-parallel ranks.

A batch of finished trajectories (the rollout record: `[B, T]` padded rows with a boolean
"real token" mask) becomes, on each data-parallel rank, a list of micro-batches in Megatron's
conventions: `input_ids` / `position_ids` / `labels` of shape `[b, t]`, one trajectory per row
(several trajectories per micro-batch are packed as rows, each right-padded to the micro-batch's
length, not concatenated into one THD sequence). Attention is causal by the layers' mask type, so
no mask tensor exists (a dense `[t, t]` mask would be 16 GiB at 128K tokens) and no real token
ever attends to the padding after it: padding is kept out of every loss by `loss_mask` alone.
Under context parallelism each row is cut into 2 x CP chunks (training/context_parallel.py), so
padded lengths are multiples of 2 x CP (x TP under sequence parallelism).

Variable lengths cost padding, so the plan
  1. spreads trajectories over data-parallel ranks by token count (longest first, each to the
     rank holding the fewest tokens): one 16x-longer trajectory loads one rank, not all of them;
  2. on each rank, packs trajectories of similar length together (sorted by length) while a
     micro-batch stays within `max_tokens_per_micro_batch` padded tokens (rows x padded length),
     or `micro_batch_size` rows when no budget is set;
  3. gives every rank the same number of micro-batches (collectives inside the model, e.g. the
     expert-parallel all-to-all, run once per micro-batch on every rank) by splitting the
     fullest micro-batches of short ranks, or, when nothing can be split, adding an empty one
     (one padding row, no action token).
Losses are token sums; Megatron divides gradients by the action-token count summed over all
micro-batches and data-parallel ranks (`calculate_per_token_loss`), so the loss of the global
batch is normalised by its global token count whatever the split.

Legend: b rows of one micro-batch, t its padded length.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_sao.models.outputs import position_ids_for, shifted_labels
from megatron_sao.platform.device import compute_device
from megatron_sao.rollout.trajectory import Trajectory, TrajectoryStatus
from megatron_sao.rollout.trajectory_batch import collate_trajectories

MicroBatch = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class PackingConfig:
    """How to cut one rank's trajectories into micro-batches."""

    micro_batch_size: int = 1
    """Rows per micro-batch when `max_tokens_per_micro_batch` is None."""
    max_tokens_per_micro_batch: int | None = None
    """Padded-token budget (rows x padded length) of one micro-batch."""
    pad_to_multiple_of: int = 1
    """Padded lengths are multiples of this (2 x CP, times TP under sequence parallelism)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1 or None, got {self.max_tokens_per_micro_batch}")
        if self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")

    def padded(self, length: int) -> int:
        return max(1, math.ceil(length / self.pad_to_multiple_of)) * self.pad_to_multiple_of

    def fits(self, num_rows: int, longest: int) -> bool:
        if self.max_tokens_per_micro_batch is None:
            return num_rows <= self.micro_batch_size
        return num_rows * self.padded(longest) <= self.max_tokens_per_micro_batch


def balance_across_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Trajectory indices per rank: longest first, each to the rank with the fewest tokens so far
    (ties: fewer trajectories, then the lower rank). Deterministic; every rank computes the same."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    assigned: list[list[int]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for index in order:
        rank = min(range(num_ranks), key=lambda r: (tokens[r], len(assigned[r]), r))
        assigned[rank].append(index)
        tokens[rank] += lengths[index]
    return assigned


def pack_by_length(indices: Sequence[int], lengths: Sequence[int], packing: PackingConfig) -> list[list[int]]:
    """Cut one rank's trajectories into micro-batches of similar length (longest first)."""
    ordered = sorted(indices, key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for index in ordered:
        # Sorted longest first, so the group's padded length is set by its first member.
        if groups and packing.fits(len(groups[-1]) + 1, lengths[groups[-1][0]]):
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def equalize_micro_batch_counts(plan: list[list[list[int]]]) -> list[list[list[int]]]:
    """Give every rank the same number of micro-batches: split each short rank's largest
    micro-batch in two while it has one of >= 2 rows; an empty list stands for a padding-only
    micro-batch."""
    target = max((len(groups) for groups in plan), default=0)
    target = max(target, 1)
    out = []
    for groups in plan:
        groups = [list(g) for g in groups]
        while len(groups) < target:
            largest = max(range(len(groups)), key=lambda i: (len(groups[i]), -i), default=None)
            if largest is None or len(groups[largest]) < 2:
                groups.append([])
                continue
            group = groups[largest]
            half = len(group) // 2
            groups[largest:largest + 1] = [group[:half], group[half:]]
        out.append(groups)
    return out


def plan_micro_batches(lengths: Sequence[int], num_ranks: int, packing: PackingConfig) -> list[list[list[int]]]:
    """`plan[rank][k]`: the trajectory indices of micro-batch k on data-parallel rank `rank`."""
    per_rank = balance_across_ranks(lengths, num_ranks)
    return equalize_micro_batch_counts([pack_by_length(idx, lengths, packing) for idx in per_rank])


def build_micro_batch(trajectories: Sequence[Trajectory], packing: PackingConfig, pad_token_id: int = 0) -> MicroBatch:
    """One micro-batch in Megatron's conventions plus the per-token training inputs.

    Keys: `input_ids`, `position_ids`, `labels` ([b, t] int64), `loss_mask` ([b, t] bool, action
    tokens), `token_mask` ([b, t] bool, real tokens), `rollout_logprobs`, `rewards` ([b, t]
    float32), `policy_versions` ([b, t] int64), `lengths`, `num_action_tokens` ([b] int64),
    `truncated` ([b] bool). An empty `trajectories` gives a one-row padding micro-batch with no
    action token.
    """
    if not trajectories:
        t = packing.padded(1)
        zeros_bt = torch.zeros(1, t)
        ids = torch.full((1, t), pad_token_id, dtype=torch.int64)
        return _finish(ids, torch.zeros(1, t, dtype=torch.bool), torch.zeros(1, t, dtype=torch.bool), zeros_bt,
                       zeros_bt.clone(), torch.full((1, t), -1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                       torch.zeros(1, dtype=torch.bool))
    padded = collate_trajectories(trajectories, pad_token_id=pad_token_id,
                                  pad_to_multiple_of=packing.pad_to_multiple_of)
    truncated = torch.tensor([t.status == TrajectoryStatus.TRUNCATED for t in trajectories], dtype=torch.bool)
    return _finish(padded.token_ids, padded.attention_mask, padded.loss_mask, padded.rollout_logprobs,
                   padded.rewards, padded.policy_versions, padded.lengths, truncated)


def _finish(ids_bt: torch.Tensor, token_mask_bt: torch.Tensor, loss_mask_bt: torch.Tensor, logprobs_bt: torch.Tensor,
            rewards_bt: torch.Tensor, versions_bt: torch.Tensor, lengths_b: torch.Tensor,
            truncated_b: torch.Tensor) -> MicroBatch:
    return {
        "input_ids": ids_bt,
        "position_ids": position_ids_for(ids_bt),
        "labels": shifted_labels(ids_bt),
        "loss_mask": loss_mask_bt,
        "token_mask": token_mask_bt,
        "rollout_logprobs": logprobs_bt.float(),
        "rewards": rewards_bt.float(),
        "policy_versions": versions_bt,
        "lengths": lengths_b,
        "num_action_tokens": loss_mask_bt.sum(dim=1),
        "truncated": truncated_b,
    }


@dataclass(slots=True)
class RankBatch:
    """This rank's share of a global batch."""

    micro_batches: list[MicroBatch]
    trajectory_indices: list[list[int]]
    """Per micro-batch, the indices (into the global batch) of its rows, in row order."""
    global_action_tokens: int


def to_device(micro_batch: MicroBatch, device: torch.device) -> MicroBatch:
    """The micro-batch with every tensor on `device` (megatron-bridge's
    `training/utils/batch_utils.py` moves batches the same way: `.cuda(non_blocking=True)`)."""
    return {key: value.to(device, non_blocking=True) for key, value in micro_batch.items()}


def shard_batch(trajectories: Sequence[Trajectory], dp_rank: int, dp_size: int, packing: PackingConfig,
                pad_token_id: int = 0) -> RankBatch:
    """Plan the global batch (identically on every rank) and build this rank's micro-batches, on
    the rank's compute device (`platform.device`)."""
    if not trajectories:
        raise ValueError("a train step needs at least one trajectory")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
    lengths = [len(t) for t in trajectories]
    plan = plan_micro_batches(lengths, dp_size, packing)
    mine = plan[dp_rank]
    device = compute_device()
    micro_batches = [to_device(build_micro_batch([trajectories[i] for i in group], packing, pad_token_id), device)
                     for group in mine]
    return RankBatch(
        micro_batches=micro_batches,
        trajectory_indices=mine,
        global_action_tokens=sum(t.num_action_tokens for t in trajectories),
    )


def padded_tokens(micro_batches: Sequence[MicroBatch]) -> int:
    """Tokens a rank actually computes on, padding included."""
    return sum(mb["input_ids"].numel() for mb in micro_batches)


def mini_batch_bounds(num_trajectories: int, num_mini_batches: int) -> list[tuple[int, int]]:
    """`[lo, hi)` of each actor mini-batch: the batch cut into `num_mini_batches` contiguous parts
    of (nearly) equal size."""
    if num_mini_batches > num_trajectories:
        raise ValueError(f"actor.num_mini_batches={num_mini_batches} exceeds the batch's {num_trajectories} "
                         "trajectories")
    bounds = [round(i * num_trajectories / num_mini_batches) for i in range(num_mini_batches + 1)]
    return list(itertools.pairwise(bounds))
