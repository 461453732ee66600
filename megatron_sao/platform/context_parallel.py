"""Megatron's context-parallel cut of a sequence, and its inverse: collectives over the CP group.

`split_sequence` gives this CP rank its two chunks of every `[b, t, ...]` tensor (2 x CP equal
chunks, rank r holding chunks r and 2 CP - 1 - r, as Megatron-Core's `get_batch_on_this_cp_rank`
cuts them); `gather_sequence` all-gathers a per-position output back to the whole sequence in
order. The trainer (training/context_parallel.py) and conversion's verify use them.
"""

from __future__ import annotations

import torch


def cp_group():
    """The context-parallel process group, or None when CP = 1."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def _cp_size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def split_sequence(batch: dict[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
    """Every `[b, t, ...]` tensor of `batch` cut to this CP rank's chunks (a new dict)."""
    if _cp_size(group) == 1:
        return dict(batch)
    from megatron.core.utils import get_batch_on_this_cp_rank

    length = next(iter(batch.values())).shape[1]
    if length % (2 * _cp_size(group)):
        raise ValueError(f"sequence length {length} is not a multiple of 2 x CP = {2 * _cp_size(group)} "
                         "(micro-batches are padded to one: training/trainer.py _pad_multiple)")
    # Megatron-Core 0.19.2 megatron/core/utils.py: without `cu_seqlens` every tensor is cut
    # per sequence (`_get_batch_on_this_cp_rank_per_sequence_balancing`), along dim 1.
    return get_batch_on_this_cp_rank({k: v.contiguous() for k, v in batch.items()}, is_hybrid_cp=False,
                                     cp_group=group)


def gather_sequence(local: torch.Tensor, group=None) -> torch.Tensor:
    """Inverse of `split_sequence` for one `[b, t_local, ...]` tensor: the whole `[b, t, ...]` in
    sequence order on every CP rank (collective over the CP group; no gradient)."""
    cp = _cp_size(group)
    if cp == 1:
        return local
    chunk = local.shape[1] // 2
    # Ranks concatenated along dim 0 (the form every backend accepts, gloo included).
    gathered = torch.empty((cp * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    torch.distributed.all_gather_into_tensor(gathered, local.detach().contiguous(), group=group)
    by_rank = gathered.view(cp, local.shape[0], 2, chunk, *local.shape[2:])
    # Sequence chunk i is held by rank i (first half) or by rank 2 cp - 1 - i (second half).
    chunks = [by_rank[i, :, 0] if i < cp else by_rank[2 * cp - 1 - i, :, 1] for i in range(2 * cp)]
    return torch.cat(chunks, dim=1)
