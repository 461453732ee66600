"""Textbook reference for skip-observation GAE: one reverse pass over the tokens.

This is the definition written as directly as possible, vectorised over the batch only, so that
the fast implementation in `gae.py` has something obviously right to be compared with (unit
tests, property tests and `tools/bench_gae.py` all use it). It is O(T) Python steps: fine for
tests, far too slow for a 128 x 131,072 training batch.

Legend: B trajectories, T tokens per (padded) trajectory.
"""

from __future__ import annotations

import torch

from megatron_sao.algo._checks import FLOAT_DTYPES, check_like_mask, check_mask, check_unit_interval, row_lambda


@torch.no_grad()
def skip_observation_gae_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Skip-observation GAE by a per-token reverse loop; same contract as `gae.skip_observation_gae`.

    Walking from the last token to the first, each row carries: the advantage and value of the
    next action token (0 past the end), and the reward seen on non-action tokens since then
    (`pending`). An action token takes `r_t + pending` as its reward, so a reward placed on an
    observation, EOS or padding token counts at the nearest preceding action token; whatever is
    still pending at t = 0 sat before the first action token and is dropped. Accumulation is in
    float64 whatever the input dtype.
    """
    check_mask(loss_mask)
    check_like_mask(rewards, "rewards", loss_mask, dtypes=FLOAT_DTYPES)
    check_like_mask(values, "values", loss_mask, dtypes=(rewards.dtype,))
    gamma = check_unit_interval(gamma, "gamma")
    batch, num_tokens = loss_mask.shape
    c_b = gamma * row_lambda(lam, batch, loss_mask.device)

    # Token-major copies so that each step reads contiguous [B] slices.
    rewards_tb = rewards.t().to(torch.float64).contiguous()
    values_tb = values.t().to(torch.float64).contiguous()
    mask_tb = loss_mask.t().contiguous()

    adv_tb = torch.zeros_like(rewards_tb)
    next_value_b = torch.zeros(batch, dtype=torch.float64, device=loss_mask.device)
    next_adv_b = torch.zeros_like(next_value_b)
    pending_b = torch.zeros_like(next_value_b)
    for t in range(num_tokens - 1, -1, -1):
        is_action_b = mask_tb[t]
        delta_b = rewards_tb[t] + pending_b + gamma * next_value_b - values_tb[t]
        adv_b = delta_b + c_b * next_adv_b
        adv_tb[t] = torch.where(is_action_b, adv_b, 0.0)
        next_value_b = torch.where(is_action_b, values_tb[t], next_value_b)
        next_adv_b = torch.where(is_action_b, adv_b, next_adv_b)
        pending_b = torch.where(is_action_b, 0.0, pending_b + rewards_tb[t])

    advantages = adv_tb.t().to(rewards.dtype).contiguous()
    returns = torch.where(loss_mask, advantages + values, 0.0)
    return advantages, returns
