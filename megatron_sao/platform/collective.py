"""Small collectives that keep every rank of a job (conversion, trainer checkpoints) on the same path.

A check that fails on one rank must fail on all of them, or the others wait forever in the next
collective. Errors found on any rank are therefore gathered and raised everywhere.

Tensors travel through the rank's compute device (`platform.device`): the default group is NCCL
on GPU, and an NCCL group has no CPU backend. The helpers take and give back tensors wherever
the caller keeps them (flags and counts usually live on the host).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_sao.platform.device import compute_device


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


def _all_reduce_in_place(tensor: torch.Tensor, op: Any) -> torch.Tensor:
    if dist.is_initialized():
        on_device = tensor.to(compute_device())
        dist.all_reduce(on_device, op=op)
        if on_device is not tensor:
            tensor.copy_(on_device)
    return tensor


def sum_over_ranks(counts: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of an integer vector over all ranks (in place)."""
    return _all_reduce_in_place(counts, dist.ReduceOp.SUM)


def any_rank_flags(flags: torch.Tensor) -> torch.Tensor:
    """Element-wise OR of an int32 flag vector over all ranks (in place)."""
    return _all_reduce_in_place(flags, dist.ReduceOp.MAX)


def any_rank(flag: bool) -> bool:
    """Collective: whether `flag` is True on any rank (e.g. a stop signal one rank received)."""
    return bool(any_rank_flags(torch.tensor([int(flag)], dtype=torch.int32))[0])


def broadcast_tensor(tensor: torch.Tensor | None, src: int, shape: tuple[int, ...], dtype: torch.dtype,
                     group: Any = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """`src`'s tensor on every rank of `group`, on `device` (the source passes its tensor, the
    others None and its shape and dtype)."""
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=compute_device())
    on_device = tensor.to(compute_device()).contiguous()
    dist.broadcast(on_device, src=src, group=group)
    return on_device.to(device)
