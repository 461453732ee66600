"""Diagnostics the paper logs (SAO section 7): staleness, DIS masking by staleness, grad-norm split.

Counts are returned as tensors (they add across micro-batches and data-parallel ranks: all-reduce
them before turning them into fractions); norms are split into squared sums for the same reason.

Legend: B trajectories, T tokens, S + 1 staleness bins.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from megatron_sao.algo._checks import check_like_mask, check_mask
from megatron_sao.algo.dis import check_band

INT_DTYPES = (torch.int32, torch.int64)

# A convenience for generic module names; the models package passes Megatron's own grouping.
ATTENTION_MOE_PATTERNS: dict[str, str] = {
    "attention": r"(attention|attn)\.",
    "moe": r"\.(experts|router|shared_experts?|gate)\.",
}


def staleness(policy_versions: torch.Tensor, current_version: int, loss_mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` int64 `current_version - policy_versions` on action tokens, 0 elsewhere.

    Raises ValueError if an action token claims a version newer than `current_version` (the
    rollout would be ahead of the actor: a bookkeeping bug upstream).
    """
    check_mask(loss_mask)
    check_like_mask(policy_versions, "policy_versions", loss_mask, dtypes=INT_DTYPES)
    age_bt = torch.where(loss_mask, int(current_version) - policy_versions.to(torch.int64), 0)
    if age_bt.numel() and int(age_bt.min()) < 0:
        raise ValueError(f"policy_versions has action tokens newer than current_version {current_version}")
    return age_bt


def _bins(age_bt: torch.Tensor, loss_mask: torch.Tensor, max_staleness: int | None) -> tuple[torch.Tensor, int]:
    """Bin index per token (ages above `max_staleness` share its bin) and the bin count."""
    if max_staleness is not None:
        if int(max_staleness) < 0:
            raise ValueError(f"max_staleness must be non-negative, got {max_staleness}")
        return age_bt.clamp(max=int(max_staleness)), int(max_staleness) + 1
    top = int(age_bt[loss_mask].max()) if bool(loss_mask.any()) else 0
    return age_bt, top + 1


def staleness_histogram(policy_versions: torch.Tensor, current_version: int, loss_mask: torch.Tensor,
                        max_staleness: int | None = None) -> torch.Tensor:
    """int64 `[S + 1]`: number of action tokens of staleness 0, 1, ..., S.

    With `max_staleness` the histogram has exactly `max_staleness + 1` bins and the last one
    counts every token at least that stale; without it, S is the largest staleness present.
    """
    age_bt = staleness(policy_versions, current_version, loss_mask)
    bin_bt, num_bins = _bins(age_bt, loss_mask, max_staleness)
    return torch.bincount(bin_bt[loss_mask], minlength=num_bins)


@dataclass(frozen=True, slots=True)
class StalenessMaskCounts:
    """DIS band counts per staleness bin, each an int64 `[S + 1]` tensor."""

    num_tokens: torch.Tensor
    masked_low: torch.Tensor
    masked_high: torch.Tensor

    def fractions(self, prefix: str = "dis/staleness_") -> dict[str, float]:
        """Flat log dict: `{prefix}{s}/masked_low_frac`, `.../masked_high_frac`, `.../num_tokens`."""
        out: dict[str, float] = {}
        rows = torch.stack([self.num_tokens, self.masked_low, self.masked_high]).tolist()
        for age, (num, low, high) in enumerate(zip(*rows, strict=True)):
            out[f"{prefix}{age}/num_tokens"] = float(num)
            out[f"{prefix}{age}/masked_low_frac"] = low / num if num else math.nan
            out[f"{prefix}{age}/masked_high_frac"] = high / num if num else math.nan
        return out


@torch.no_grad()
def masked_fraction_by_staleness(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    policy_versions: torch.Tensor,
    current_version: int,
    loss_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    max_staleness: int | None = None,
) -> StalenessMaskCounts:
    """How many action tokens of each staleness fall below / above the DIS band.

    Same band as `dis_policy_loss` (below: rho <= 1 - eps_low, above: rho >= 1 + eps_high), so
    one can see whether masking grows with the age of the tokens, which is what the band is for.
    """
    check_like_mask(logprobs, "logprobs", loss_mask)
    check_like_mask(rollout_logprobs, "rollout_logprobs", loss_mask)
    eps_low, eps_high = check_band(eps_low, eps_high)
    age_bt = staleness(policy_versions, current_version, loss_mask)
    bin_bt, num_bins = _bins(age_bt, loss_mask, max_staleness)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    rho = torch.exp(torch.where(loss_mask, logprobs.to(dtype) - rollout_logprobs.to(dtype), 0.0))
    below = loss_mask & (rho <= 1.0 - eps_low)
    above = loss_mask & (rho >= 1.0 + eps_high)
    return StalenessMaskCounts(
        num_tokens=torch.bincount(bin_bt[loss_mask], minlength=num_bins),
        masked_low=torch.bincount(bin_bt[below], minlength=num_bins),
        masked_high=torch.bincount(bin_bt[above], minlength=num_bins),
    )


GroupSpec = Callable[[str], str | None] | Mapping[str, str]


def _group_of(spec: GroupSpec, default_group: str) -> Callable[[str], str]:
    if callable(spec):
        return lambda name: spec(name) or default_group
    if not isinstance(spec, Mapping):
        raise ValueError("groups must be a callable name -> group or a mapping group -> regex")
    compiled = [(group, re.compile(pattern)) for group, pattern in spec.items()]

    def group_of(name: str) -> str:
        return next((group for group, pattern in compiled if pattern.search(name)), default_group)

    return group_of


@torch.no_grad()
def grad_sq_norms_by_group(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], groups: GroupSpec,
                           default_group: str = "other") -> dict[str, torch.Tensor]:
    """Sum of squared gradient entries per group, as 0-dim float32 tensors (no host sync).

    `groups` maps a parameter name to its group: a callable (None means `default_group`) or a
    mapping group -> regex, searched in order, first match wins. Parameters without a gradient
    (frozen, or unused this step) are skipped; a group with none has no entry. These are this
    rank's sums: all-reduce them over the ranks that shard the parameters before the square root.
    """
    group_of = _group_of(groups, default_group)
    grads: dict[str, list[torch.Tensor]] = {}
    for name, param in named_parameters:
        if param.grad is not None:
            grads.setdefault(group_of(name), []).append(param.grad)
    return {group: torch.nn.utils.get_total_norm(tensors).float().square() for group, tensors in grads.items()}


def grad_norm_by_group(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], groups: GroupSpec,
                       default_group: str = "other") -> dict[str, float]:
    """L2 gradient norm per group plus `"total"` (all groups), as floats (this rank's gradients).

    The paper's critic diagnostic: attention / MoE / other norms, where the full-parameter
    critic's attention gradient stood out.
    """
    sq = grad_sq_norms_by_group(named_parameters, groups, default_group)
    if "total" in sq:
        raise ValueError("'total' is reserved for the overall norm; rename that group")
    if not sq:
        return {"total": 0.0}
    names = list(sq)
    values = torch.stack([sq[n].to(torch.float64).cpu() for n in names]).tolist()
    out = {name: math.sqrt(v) for name, v in zip(names, values, strict=True)}
    out["total"] = math.sqrt(sum(values))
    return out
