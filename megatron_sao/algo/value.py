"""Critic loss and the critic's explained variance (SAO section 3, diagnostics in section 7).

The critic regresses V(s_t) on the GAE value targets (`returns` of `skip_observation_gae`, usually
with lambda_critic = 1) on action tokens only; observation tokens get no value target. With
`clip_range` set, the loss is PPO's clipped value loss: the prediction may move at most
`clip_range` away from the value the critic gave at rollout time before the error stops shrinking
the loss, which keeps the K critic steps on one batch from overfitting it.

Legend: B trajectories, T tokens.
"""

from __future__ import annotations

import math

import torch

from megatron_sao.algo._checks import check_like_mask, check_mask, normaliser


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip_range: float | None = None,
    num_tokens: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean squared error of the critic over action tokens, optionally PPO-clipped.

    Args:
        values: `[B, T]` predictions V(s_t) of the critic being trained (carry gradient).
        returns: `[B, T]` value targets (constants).
        loss_mask: bool `[B, T]`, True on action tokens.
        old_values: `[B, T]` values at rollout time (those the targets were computed from);
            required when `clip_range` is set.
        clip_range: None for plain MSE; else `max((V - R)^2, (V_clip - R)^2)` per token with
            `V_clip = old + clamp(V - old, -clip_range, clip_range)`.
        num_tokens: denominator, as in `dis_policy_loss`: default this call's action-token count;
            the trainer passes the global batch's count so that micro-batch losses sum to the
            global loss.

    Returns:
        `(loss, stats)`: the 0-dim loss (no 1/2 factor) and, as 0-dim float64 tensors on the
        inputs' device (see `dis_policy_loss`), over this call's action tokens: `mse`
        (unclipped), `clip_frac` (tokens where the clipped error is the larger, 0 without
        clipping), `value_mean`, `return_mean`, `explained_variance`, `num_action_tokens`.
    """
    check_mask(loss_mask)
    check_like_mask(values, "values", loss_mask)
    check_like_mask(returns, "returns", loss_mask)
    if clip_range is not None:
        clip_range = float(clip_range)
        if not clip_range > 0:
            raise ValueError(f"clip_range must be positive or None, got {clip_range}")
        if old_values is None:
            raise ValueError("old_values is required when clip_range is set")
    if old_values is not None:
        check_like_mask(old_values, "old_values", loss_mask)

    # Off action tokens every operand is replaced by 0 before any arithmetic, so that NaN or inf
    # there (padding) reaches neither the loss nor, through 0 * NaN, the gradient.
    dtype = torch.promote_types(values.dtype, torch.float32)
    pred = torch.where(loss_mask, values.to(dtype), 0.0)
    target = torch.where(loss_mask, returns.detach().to(dtype), 0.0)
    err = (pred - target).square()
    clipped_larger = torch.zeros_like(loss_mask)
    per_token = err
    if clip_range is not None:
        old = torch.where(loss_mask, old_values.detach().to(dtype), 0.0)
        pred_clipped = old + (pred - old).clamp(-clip_range, clip_range)
        err_clipped = (pred_clipped - target).square()
        clipped_larger = loss_mask & (err_clipped > err)
        per_token = torch.maximum(err, err_clipped)
    loss = per_token.sum() / normaliser(num_tokens, loss_mask, pred)

    with torch.no_grad():
        num = loss_mask.sum().to(torch.float64)
        denom = num.clamp_min(1.0)

        def mean(total: torch.Tensor) -> torch.Tensor:
            return torch.where(num > 0, total.to(torch.float64) / denom, torch.nan)

        stats = {
            "mse": mean(err.sum()),
            "clip_frac": clipped_larger.sum().to(torch.float64) / denom,
            "value_mean": mean(pred.sum()),
            "return_mean": mean(target.sum()),
            "explained_variance": _explained_variance_of_moments(
                explained_variance_moments(values.detach(), returns, loss_mask)),
            "num_action_tokens": num,
        }
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor,
                       min_return_var: float = 0.0) -> float:
    """`1 - Var(R - V) / Var(R)` over action tokens (population variances, float64).

    1 is a perfect critic, 0 one that only knows the mean return, negative one worse than that.
    NaN when there are fewer than two action tokens or the returns do not vary: variance at most
    `min_return_var` (a batch whose returns are nearly all equal says nothing about the critic:
    one failure among 31 successes gives any EV from -30 to 1), or at most 1e-12 of their mean
    square (round-off of a constant).
    """
    check_mask(loss_mask)
    check_like_mask(values, "values", loss_mask)
    check_like_mask(returns, "returns", loss_mask)
    with torch.no_grad():
        ret = returns[loss_mask].to(torch.float64)
        resid = ret - values[loss_mask].to(torch.float64)
        if ret.numel() < 2:
            return math.nan
        var_ret = float(ret.var(unbiased=False))
        var_resid = float(resid.var(unbiased=False))
        flat = _flat(var_ret, float(ret.square().mean()), min_return_var)
        return math.nan if flat else 1.0 - var_resid / var_ret


def explained_variance_moments(values: torch.Tensor, returns: torch.Tensor,
                               loss_mask: torch.Tensor) -> torch.Tensor:
    """Float64 `[5]` sums `(n, sum R, sum R^2, sum (R - V), sum (R - V)^2)` over action tokens.

    Sums add across micro-batches and data-parallel ranks (all-reduce them), which per-call
    explained variances do not; `explained_variance_from_moments` finishes the computation.
    """
    check_mask(loss_mask)
    check_like_mask(values, "values", loss_mask)
    check_like_mask(returns, "returns", loss_mask)
    with torch.no_grad():
        ret = torch.where(loss_mask, returns.to(torch.float64), 0.0)
        resid = torch.where(loss_mask, ret - values.to(torch.float64), 0.0)
        return torch.stack([loss_mask.sum().to(torch.float64), ret.sum(), ret.square().sum(), resid.sum(),
                            resid.square().sum()])


def explained_variance_from_moments(moments: torch.Tensor, min_return_var: float = 0.0) -> float:
    """Explained variance from (summed) `explained_variance_moments`; NaN as in `explained_variance`.

    Uses E[x^2] - E[x]^2 in float64, accurate while |mean| / std of the returns stays far below
    1e7 (rewards are O(1) in practice).
    """
    if moments.shape != (5,):
        raise ValueError(f"moments must be a [5] tensor, got shape {tuple(moments.shape)}")
    n, s_ret, s2_ret, s_res, s2_res = moments.to(torch.float64).tolist()
    if n < 2:
        return math.nan
    var_ret = s2_ret / n - (s_ret / n) ** 2
    var_res = s2_res / n - (s_res / n) ** 2
    return math.nan if _flat(var_ret, s2_ret / n, min_return_var) else 1.0 - var_res / var_ret


def _explained_variance_of_moments(moments: torch.Tensor) -> torch.Tensor:
    """`explained_variance_from_moments` as a 0-dim tensor on the moments' device (no transfer)."""
    n, s_ret, s2_ret, s_res, s2_res = moments.to(torch.float64).unbind()
    denom = n.clamp_min(1.0)
    var_ret = s2_ret / denom - (s_ret / denom) ** 2
    var_res = s2_res / denom - (s_res / denom) ** 2
    defined = (n >= 2) & (var_ret > 1e-12 * (s2_ret / denom))
    return torch.where(defined, 1.0 - var_res / torch.where(defined, var_ret, 1.0), torch.nan)


def return_variance_from_moments(moments: torch.Tensor) -> float:
    """Population variance of the returns summed in `explained_variance_moments` (NaN for n < 1)."""
    n, s_ret, s2_ret = moments.to(torch.float64).tolist()[:3]
    return max(s2_ret / n - (s_ret / n) ** 2, 0.0) if n >= 1 else math.nan


def _flat(var: float, mean_square: float, min_return_var: float = 0.0) -> bool:
    """Whether the returns are too flat to judge a critic by: variance at most `min_return_var`,
    or round-off of a constant (relative to the mean square)."""
    if min_return_var < 0:
        raise ValueError(f"min_return_var must be >= 0, got {min_return_var}")
    return var <= min_return_var or var <= 1e-12 * mean_square
