"""DIS: direct double-sided importance sampling, SAO's policy loss (SAO section 2).

For every action token the importance ratio against the rollout engine's own log-prob,
`rho = exp(logp_theta - rollout_logprob)`, is a detached weight, and a token whose ratio leaves
the open band `(1 - eps_low, 1 + eps_high)` is removed from the gradient whatever the sign of its
advantage (PPO clipping would keep some of them, depending on that sign). No old-policy
recomputation and no checkpoint history are needed: the denominator is what the engine sampled
with, which also absorbs engine/trainer numerical mismatch and staleness in one ratio.

Legend: B trajectories, T tokens.
"""

from __future__ import annotations

import torch

from megatron_sao.algo._checks import check_like_mask, check_mask, normaliser


def check_band(eps_low: float, eps_high: float) -> tuple[float, float]:
    """`eps_low` in (0, 1) and `eps_high` > 0 (may be inf: no upper edge)."""
    eps_low, eps_high = float(eps_low), float(eps_high)
    if not 0.0 < eps_low < 1.0:
        raise ValueError(f"eps_low must be in (0, 1), got {eps_low}")
    if not eps_high > 0.0:
        raise ValueError(f"eps_high must be positive, got {eps_high}")
    return eps_low, eps_high


def dis_policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    num_tokens: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DIS policy loss `-sum(kept * rho.detach() * A * logp) / num_tokens` and its statistics.

    Args:
        logprobs: `[B, T]` log-probs of the sampled tokens under the policy being trained (the
            only input that carries gradient).
        rollout_logprobs: `[B, T]` log-probs the rollout engine assigned when it sampled them.
        advantages: `[B, T]` advantages (treated as constants).
        loss_mask: bool `[B, T]`, True on action tokens.
        eps_low, eps_high: the band; a token is kept iff it is an action token and
            `1 - eps_low < rho < 1 + eps_high` (both edges excluded; a NaN ratio is not kept).
            Paper: 0.3 / 5.0 for math with Python, 0.8 / 3.0 for SWE coding.
        num_tokens: the denominator. Default: this call's action-token count, so tokens removed
            by the band still count. The trainer passes the action-token count of the whole
            global batch (all micro-batches, all data-parallel ranks) so that summing the losses
            of micro-batches gives the loss of the global batch. A count below 1 counts as 1.

    Returns:
        `(loss, stats)`: a 0-dim loss in `logprobs`' dtype (float32 at least) whose gradient with
        respect to `logprobs` is exactly `-kept * rho * advantages / num_tokens`; `stats` holds
        0-dim float64 tensors on the inputs' device (nothing waits for the device; `float(v)`
        reads one) over this call's action tokens: `masked_low_frac` (rho <= 1 - eps_low),
        `masked_high_frac` (rho >= 1 + eps_high), `masked_frac`, `ratio_mean`, `ratio_min`,
        `ratio_max` (NaN without action tokens), `kl_k3` (mean of rho - 1 - log rho, an estimate
        of KL(rollout || policy)), and the counts `num_action_tokens`, `num_masked_low`,
        `num_masked_high` for summing across micro-batches and ranks.

    Non-action positions may hold anything (padding log-probs of -inf included): they reach
    neither the loss nor the gradient.
    """
    check_mask(loss_mask)
    check_like_mask(logprobs, "logprobs", loss_mask)
    check_like_mask(rollout_logprobs, "rollout_logprobs", loss_mask)
    check_like_mask(advantages, "advantages", loss_mask)
    eps_low, eps_high = check_band(eps_low, eps_high)

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logp = logprobs.to(dtype)
    log_ratio = torch.where(loss_mask, logp.detach() - rollout_logprobs.detach().to(dtype), 0.0)
    rho = torch.exp(log_ratio)
    below = loss_mask & (rho <= 1.0 - eps_low)
    above = loss_mask & (rho >= 1.0 + eps_high)
    # Written as the band test itself, so a NaN ratio is never kept (and counts as neither side).
    kept = loss_mask & (rho > 1.0 - eps_low) & (rho < 1.0 + eps_high)
    # Both `where`s matter: the first keeps NaN/inf weights of removed tokens out of the backward
    # product, the second keeps -inf log-probs of padding out of the forward sum.
    weight = torch.where(kept, rho * advantages.detach().to(dtype), 0.0)
    loss = -torch.where(kept, weight * logp, 0.0).sum() / normaliser(num_tokens, loss_mask, logp)
    return loss, _ratio_stats(rho, log_ratio, loss_mask, below, above)


@torch.no_grad()
def _ratio_stats(rho: torch.Tensor, log_ratio: torch.Tensor, loss_mask: torch.Tensor, below: torch.Tensor,
                 above: torch.Tensor) -> dict[str, torch.Tensor]:
    """Band statistics over action tokens, as 0-dim float64 tensors on the inputs' device."""
    if loss_mask.numel() == 0:  # min / max of an empty tensor would raise
        rho, log_ratio, loss_mask = rho.new_ones(1, 1), log_ratio.new_zeros(1, 1), loss_mask.new_zeros(1, 1)
    num = loss_mask.sum().to(torch.float64)
    rho64 = rho.to(torch.float64)
    has_tokens = num > 0
    denom = num.clamp_min(1.0)
    k3 = torch.where(loss_mask, rho64 - 1.0 - log_ratio.to(torch.float64), 0.0)
    low, high = below.sum().to(torch.float64), above.sum().to(torch.float64)
    return {
        "masked_low_frac": low / denom,
        "masked_high_frac": high / denom,
        "masked_frac": (low + high) / denom,
        "ratio_mean": torch.where(has_tokens, torch.where(loss_mask, rho64, 0.0).sum() / denom, torch.nan),
        "ratio_min": torch.where(has_tokens, torch.where(loss_mask, rho64, torch.inf).min(), torch.nan),
        "ratio_max": torch.where(has_tokens, torch.where(loss_mask, rho64, -torch.inf).max(), torch.nan),
        "kl_k3": torch.where(has_tokens, k3.sum() / denom, torch.nan),
        "num_action_tokens": num,
        "num_masked_low": low,
        "num_masked_high": high,
    }
