"""Routing replay data: each trainer rank receives the routing of its own micro-batches only.

A batch's routing is `[tokens, MoE layers, k]` int16 per trajectory: for Qwen3-30B-A3B 48 x 8 x 2
= 768 bytes per token, ~25x the rest of the record. Broadcasting it with the trajectories to every
rank multiplies that by the world size (slime issue 2384: host memory exhausted). Here only the
rank that holds the batch (global rank 0: the engine source's receiver, the recorded source's
only reader of routing) keeps it; every step it cuts, for every rank, the part that rank's
routers will see and scatters those parts:

- the rank's data-parallel share: the actor micro-batches `shard_batch` builds for that DP rank,
  mini-batch by mini-batch (the plan is a pure function of the lengths, computed alike here);
- the MoE layers of its pipeline stage (all its virtual stages), `RoutingReplayer.layers`;
- the sequence positions its routers see: its context-parallel chunks (Megatron's per-sequence
  zigzag: chunks r and 2cp-1-r of 2cp, `megatron/core/utils.py::
  _get_batch_on_this_cp_rank_per_sequence_balancing`) and, under sequence parallelism, its
  tensor-parallel part of those (Megatron splits the sequence dimension in TP-rank order).

Each rank describes what it needs once (`RoutingNeed`, all-gathered when the trainer is built).
The receiving rank attaches `micro_batch["routed_experts"]` `[b, s, L_local, k]` (`NOT_ROUTED` for
padding and for tokens without routing). Rank 0 also reports, for everyone:
`moe/replay_missing_frac` (token positions that feed a log-prob, i.e. all but each trajectory's
last, with no engine routing), `moe/replay_batch_mb` (the batch's routing, held by rank 0 only)
and `moe/replay_rank_mb_max` (the largest part one rank received).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_sao.rollout.routing import NOT_ROUTED
from megatron_sao.rollout.trajectory import Trajectory
from megatron_sao.training.batches import PackingConfig, mini_batch_bounds, plan_micro_batches

_MB = 2**20


@dataclass(frozen=True, slots=True)
class RoutingNeed:
    """What one rank's actor routers see of every micro-batch."""

    dp_rank: int
    layers: tuple[int, ...]
    """Record MoE-layer indices of the rank's routers, in its payload order."""
    cp_rank: int = 0
    cp_size: int = 1
    seq_part: int = 0
    seq_parts: int = 1
    """Tensor-parallel size under sequence parallelism (each TP rank routes its part), else 1."""

    def positions(self, seq_len: int) -> np.ndarray:
        """The sequence positions of a `seq_len`-long micro-batch this rank's routers see, in the
        order they see them."""
        positions = np.arange(seq_len)
        if self.cp_size > 1:
            chunks = np.array_split(positions, 2 * self.cp_size)
            positions = np.concatenate([chunks[self.cp_rank], chunks[2 * self.cp_size - 1 - self.cp_rank]])
        if self.seq_parts > 1:
            positions = np.array_split(positions, self.seq_parts)[self.seq_part]
        return positions


def local_need(layers: Sequence[int], sequence_parallel: bool) -> RoutingNeed:
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    return RoutingNeed(dp_rank=ps.get_data_parallel_rank(), layers=tuple(layers),
                       cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
                       seq_part=ps.get_tensor_model_parallel_rank() if sequence_parallel else 0,
                       seq_parts=tp_size if sequence_parallel else 1)


def gather_needs(need: RoutingNeed) -> list[RoutingNeed]:
    """Collective (once): every rank's need, indexed by global rank."""
    needs: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(needs, need)
    return needs


def actor_groups(lengths: Sequence[int], num_mini_batches: int, dp_size: int,
                 packing: PackingConfig) -> list[list[list[int]]]:
    """`groups[dp_rank]`: the global trajectory indices of each actor micro-batch of that DP rank,
    mini-batch after mini-batch, in the order the trainer builds them."""
    groups: list[list[list[int]]] = [[] for _ in range(dp_size)]
    for lo, hi in mini_batch_bounds(len(lengths), num_mini_batches):
        plan = plan_micro_batches(lengths[lo:hi], dp_size, packing)
        for dp_rank in range(dp_size):
            groups[dp_rank].extend([[lo + i for i in group] for group in plan[dp_rank]])
    return groups


def _rank_part(trajectories: Sequence[Trajectory], groups: list[list[int]], need: RoutingNeed,
               packing: PackingConfig, topk: int) -> list[np.ndarray]:
    layers = list(need.layers)
    out = []
    for group in groups:
        seq_len = packing.padded(max((len(trajectories[i]) for i in group), default=1))
        positions = need.positions(seq_len)
        part_bslk = np.full((max(len(group), 1), len(positions), len(layers), topk), NOT_ROUTED, dtype=np.int16)
        for row, index in enumerate(group):
            routed = trajectories[index].routed_experts
            if routed is None:
                continue
            inside = positions < routed.num_tokens
            part_bslk[row, inside] = routed.indices_nlk[positions[inside]][:, layers, :]
        out.append(part_bslk)
    return out


def _check_layout(trajectories: Sequence[Trajectory], num_moe_layers: int, topk: int) -> None:
    for traj in trajectories:
        routed = traj.routed_experts
        if routed is not None and (routed.num_layers, routed.topk) != (num_moe_layers, topk):
            raise ValueError(f"trajectory {traj.trajectory_id}: routed_experts has {routed.num_layers} MoE layers x "
                             f"top-{routed.topk}, the actor has {num_moe_layers} x top-{topk}")


def missing_fraction(trajectories: Sequence[Trajectory]) -> float:
    """Token positions that feed a log-prob (all but each trajectory's last) without routing."""
    total = missing = 0
    for traj in trajectories:
        n = max(len(traj) - 1, 0)
        total += n
        routed = traj.routed_experts
        missing += n if routed is None else int((~routed.routed_mask()[:n]).sum())
    return missing / total if total else 0.0


def build_parts(trajectories: Sequence[Trajectory], needs: Sequence[RoutingNeed], num_mini_batches: int,
                dp_size: int, packing: PackingConfig, num_moe_layers: int, topk: int) -> list[dict[str, Any]]:
    """Rank 0: every rank's part of the batch's routing, and the step's replay metrics."""
    _check_layout(trajectories, num_moe_layers, topk)
    metrics = {"moe/replay_missing_frac": missing_fraction(trajectories),
               "moe/replay_batch_mb": sum(t.routed_experts.nbytes for t in trajectories if t.routed_experts) / _MB,
               "moe/replay_rank_mb_max": 0.0}
    if not any(t.routed_experts is not None for t in trajectories):  # nothing to replay: every router routes
        return [{"micro_batches": None, "metrics": metrics, "error": None} for _ in needs]
    groups = actor_groups([len(t) for t in trajectories], num_mini_batches, dp_size, packing)
    parts = [_rank_part(trajectories, groups[need.dp_rank], need, packing, topk) for need in needs]
    metrics["moe/replay_rank_mb_max"] = max(sum(p.nbytes for p in part) for part in parts) / _MB
    return [{"micro_batches": part, "metrics": metrics, "error": None} for part in parts]


def scatter_parts(trajectories: Sequence[Trajectory] | None, needs: Sequence[RoutingNeed], num_mini_batches: int,
                  dp_size: int, packing: PackingConfig, num_moe_layers: int, topk: int) -> dict[str, Any]:
    """Collective: rank 0 (whose `trajectories` carry the routing; other ranks pass None) sends
    each rank its part; returns this rank's. A bad batch raises on every rank."""
    rank0 = torch.distributed.get_rank() == 0
    parts = None
    if rank0:
        try:
            parts = build_parts(trajectories or [], needs, num_mini_batches, dp_size, packing, num_moe_layers, topk)
        except ValueError as e:
            parts = [{"error": str(e)}] * len(needs)
    received: list[Any] = [None]
    torch.distributed.scatter_object_list(received, parts, src=0)
    mine = received[0]
    if mine["error"]:
        raise ValueError(f"routing replay: {mine['error']}")
    return mine


def attach(micro_batches: Sequence[dict[str, torch.Tensor]], parts: Sequence[np.ndarray] | None) -> None:
    """`micro_batch["routed_experts"]` for each of this rank's actor micro-batches (in order), on
    the micro-batch's device; nothing when the batch has no routing (`parts` None)."""
    if parts is None:
        return
    if len(parts) != len(micro_batches):
        raise AssertionError(f"{len(parts)} routing parts for {len(micro_batches)} actor micro-batches")
    for micro_batch, part_bslk in zip(micro_batches, parts, strict=True):
        if part_bslk.shape[0] != micro_batch["input_ids"].shape[0]:
            raise AssertionError(f"routing part of {part_bslk.shape[0]} rows for a micro-batch of "
                                 f"{micro_batch['input_ids'].shape[0]}")
        micro_batch["routed_experts"] = torch.from_numpy(part_bslk).to(device=micro_batch["input_ids"].device)
