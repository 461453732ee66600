"""PPO clipped surrogate with clip-higher: the policy loss of the GRPO baselines (SAO section 5).

    L = -sum_t min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t) / num_tokens

with `r_t = exp(logp_theta - logp_old)` carrying gradient. Clip-higher (DAPO) is only an upper
range wider than the lower one (paper GRPO runs: 0.2 / 0.28), which leaves low-probability tokens
more room to grow. Unlike DIS, whether a token's gradient vanishes depends on the sign of its
advantage: a ratio above the band with a negative advantage still pushes down. `logp_old` is
whatever the trainer treats as the behaviour policy: recomputed old log-probs for a synchronous
GRPO run, or the rollout log-probs.

Legend: B trajectories, T tokens.
"""

from __future__ import annotations

import torch

from megatron_sao.algo._checks import check_like_mask, check_mask, normaliser


def ppo_clip_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    num_tokens: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate over action tokens, normalised like `dis_policy_loss`.

    Args:
        logprobs: `[B, T]` log-probs under the policy being trained (carry gradient).
        old_logprobs: `[B, T]` behaviour-policy log-probs (constants).
        advantages: `[B, T]` advantages (constants), e.g. `grpo_advantages`.
        loss_mask: bool `[B, T]`, True on action tokens.
        clip_low: lower clip range in (0, 1).
        clip_high: upper clip range, > 0 (clip-higher: larger than `clip_low`).
        num_tokens: denominator; default this call's action-token count (see `dis_policy_loss`).

    Returns:
        `(loss, stats)`, `stats` as in `dis_policy_loss` (0-dim float64 tensors on the inputs'
        device) over this call's action tokens: `clip_frac` (the clipped term is the smaller, so
        the token has no gradient), `clip_low_frac` / `clip_high_frac` (its split by side),
        `ratio_mean`, `kl_k3` (mean of r - 1 - log r), `num_action_tokens`.
    """
    check_mask(loss_mask)
    check_like_mask(logprobs, "logprobs", loss_mask)
    check_like_mask(old_logprobs, "old_logprobs", loss_mask)
    check_like_mask(advantages, "advantages", loss_mask)
    clip_low, clip_high = float(clip_low), float(clip_high)
    if not 0.0 < clip_low < 1.0:
        raise ValueError(f"clip_low must be in (0, 1), got {clip_low}")
    if not clip_high > 0.0:
        raise ValueError(f"clip_high must be positive, got {clip_high}")

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logp = logprobs.to(dtype)
    adv = torch.where(loss_mask, advantages.detach().to(dtype), 0.0)
    log_ratio = torch.where(loss_mask, logp - old_logprobs.detach().to(dtype), 0.0)
    ratio = torch.exp(log_ratio)
    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.where(loss_mask, torch.minimum(surr, surr_clipped), 0.0).sum()
    loss = loss / normaliser(num_tokens, loss_mask, logp)

    with torch.no_grad():
        clipped = loss_mask & (surr_clipped < surr)
        low = clipped & (ratio < 1.0 - clip_low)
        high = clipped & (ratio > 1.0 + clip_high)
        num = loss_mask.sum().to(torch.float64)
        denom = num.clamp_min(1.0)
        ratio64, log_ratio64 = ratio.detach().to(torch.float64), log_ratio.detach().to(torch.float64)
        stats = {
            "clip_frac": clipped.sum() / denom,
            "clip_low_frac": low.sum() / denom,
            "clip_high_frac": high.sum() / denom,
            "ratio_mean": torch.where(num > 0, torch.where(loss_mask, ratio64, 0.0).sum() / denom, torch.nan),
            "kl_k3": torch.where(num > 0, torch.where(loss_mask, ratio64 - 1.0 - log_ratio64, 0.0).sum() / denom,
                                 torch.nan),
            "num_action_tokens": num,
        }
    return loss, stats
