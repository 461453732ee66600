"""Small collectives that keep every rank of a job (conversion, trainer checkpoints) on the same path.

A check that fails on one rank must fail on all of them, or the others wait forever in the next
collective. Errors found on any rank are therefore gathered and raised everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def raise_if_any(errors: list[str], limit: int = 8) -> None:
    """Collective: raise ValueError on every rank if any rank has errors (first `limit` shown)."""
    merged: list[str] = []
    for rank_errors in gather_objects(list(errors)):
        merged.extend(e for e in rank_errors if e not in merged)
    if merged:
        more = f"\n... and {len(merged) - limit} more" if len(merged) > limit else ""
        raise ValueError("\n".join(merged[:limit]) + more)


def sum_over_ranks(counts: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of an integer vector over all ranks (in place)."""
    if dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return counts


def any_rank_flags(flags: torch.Tensor) -> torch.Tensor:
    """Element-wise OR of an int32 flag vector over all ranks."""
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags
