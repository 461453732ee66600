"""Gradient norms per parameter group (attention, experts, router, ...) of a Megatron role.

The paper's critic diagnostic splits the gradient norm into attention / MoE / other. Megatron's
optimizer reports only the total, so this module computes the split from the same gradients
(after `finalize_model_grads`, before clipping) with the same bookkeeping as Megatron's own norm:
each gradient element counted exactly once over the whole world, i.e.
  - tensor-parallel duplicates (norms, routers, the value head) only on one TP rank
    (`param_is_not_tensor_parallel_duplicate`);
  - with the distributed optimizer, only the slice of `main_grad` this data-parallel rank owns
    after the reduce-scatter (the other slices are stale there);
  - without it, gradients are replicated over data parallel: counted on the first DP rank only
    (the expert-DP rank for expert parameters).
Frozen groups have no gradient and are reported as 0, not left out. The squared sums of the
groups add up to the square of Megatron's total norm (a test checks it).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_sao.models.param_groups import GROUPS, param_group
from megatron_sao.platform.device import compute_device


def _range_maps(optimizer: Any) -> dict[torch.nn.Parameter, tuple[int, int]]:
    """model param -> (start, end) of the flattened slice this rank owns (distributed optimizer)."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    owned: dict[torch.nn.Parameter, tuple[int, int]] = {}
    for sub in subs:
        if not hasattr(sub, "model_param_gbuf_map"):
            continue
        for param in sub.model_param_gbuf_map:
            param_range = sub._get_model_param_range_map(param)["param"]
            owned[param] = (param_range.start, param_range.end)
    return owned


def grad_sq_norms_by_group(chunks: list[torch.nn.Module], optimizer: Any,
                           use_distributed_optimizer: bool) -> dict[str, float]:
    """Collective (every rank): `{group: sum of squared gradient entries}` over the whole model,
    for every group that has parameters anywhere; `inf`/`nan` propagate (a non-finite entry on
    any rank makes its group non-finite on all ranks)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    owned = _range_maps(optimizer) if use_distributed_optimizer else {}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    first_dp = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    first_expert_dp = parallel_state.get_expert_data_parallel_rank() == 0
    index = {group: i for i, group in enumerate(GROUPS)}
    sq = torch.zeros(len(GROUPS), dtype=torch.float64, device=compute_device())
    present = torch.zeros(len(GROUPS), dtype=torch.float64, device=compute_device())
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            i = index[param_group(name)]
            present[i] = 1.0
            grad = getattr(param, "main_grad", None)
            if not param.requires_grad or grad is None:
                continue
            if not param_is_not_tensor_parallel_duplicate(param, tp_group=tp_group, expert_tp_group=etp_group):
                continue
            flat = grad.detach().reshape(-1)
            if use_distributed_optimizer:
                if param not in owned:
                    continue
                start, end = owned[param]
                flat = flat[start:end]
            elif not (first_dp if getattr(param, "allreduce", True) else first_expert_dp):
                continue
            sq[i] += flat.double().square().sum()
    stacked = torch.stack([sq, present])
    torch.distributed.all_reduce(stacked)
    sums, has = stacked.tolist()  # one transfer, not one per group
    return {group: sums[i] for group, i in index.items() if has[i] > 0}
