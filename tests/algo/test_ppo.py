"""PPO clipped surrogate with clip-higher (GRPO baselines). Tolerances: float64 at rtol 1e-12."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_sao.algo import ppo_clip_policy_loss


def _loss_and_grad(ratio: list[float], advantage: list[float], clip_low: float = 0.2,
                   clip_high: float = 0.28) -> tuple[float, list[float], dict]:
    logprobs = torch.log(torch.tensor([ratio], dtype=torch.float64)).requires_grad_()
    advantages = torch.tensor([advantage], dtype=torch.float64)
    loss, stats = ppo_clip_policy_loss(logprobs, torch.zeros_like(logprobs), advantages,
                                       torch.ones_like(logprobs, dtype=torch.bool), clip_low, clip_high)
    loss.backward()
    return loss.item(), logprobs.grad[0].tolist(), stats


def test_inside_the_band_the_gradient_is_the_importance_weighted_advantage() -> None:
    loss, grad, stats = _loss_and_grad([0.9, 1.1], [2.0, -1.0])
    assert loss == pytest.approx(-(0.9 * 2.0 - 1.1) / 2, rel=1e-12)
    # d/dlogp of -r A / N is -r A / N.
    assert grad == pytest.approx([-0.9 * 2.0 / 2, 1.1 / 2], rel=1e-12)
    assert stats["clip_frac"] == 0.0


def test_clipping_depends_on_the_advantage_sign() -> None:
    # Above 1 + clip_high: no gradient for A > 0, full gradient for A < 0 (unlike DIS).
    loss, grad, stats = _loss_and_grad([1.5, 1.5, 0.5, 0.5], [1.0, -1.0, 1.0, -1.0])
    assert grad[0] == 0.0 and grad[1] == pytest.approx(1.5 / 4)
    assert grad[2] == pytest.approx(-0.5 / 4) and grad[3] == 0.0
    assert loss == pytest.approx(-(1.28 - 1.5 + 0.5 - 0.8) / 4, rel=1e-12)
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["clip_high_frac"] == pytest.approx(0.25) and stats["clip_low_frac"] == pytest.approx(0.25)


def test_clip_higher_is_asymmetric() -> None:
    # ratio 1.25 is inside (0.8, 1.28) but would be clipped by a symmetric 0.2 range.
    _, grad_higher, _ = _loss_and_grad([1.25], [1.0], clip_low=0.2, clip_high=0.28)
    _, grad_symmetric, _ = _loss_and_grad([1.25], [1.0], clip_low=0.2, clip_high=0.2)
    assert grad_higher[0] == pytest.approx(-1.25) and grad_symmetric[0] == 0.0


def test_micro_batches_with_global_normaliser_sum_to_the_batch_loss_and_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(5, 12, generator=gen, dtype=torch.float64)
    logprobs = (old + 0.6 * torch.randn(5, 12, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    mask = torch.rand(5, 12, generator=gen) < 0.7
    full, _ = ppo_clip_policy_loss(logprobs, old, adv, mask)
    full.backward()
    micro = logprobs.detach().clone().requires_grad_()
    summed = sum(ppo_clip_policy_loss(micro[r], old[r], adv[r], mask[r], num_tokens=mask.sum())[0]
                 for r in (slice(0, 2), slice(2, 5)))
    summed.backward()
    assert summed.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(micro.grad, logprobs.grad, rtol=1e-12, atol=1e-15)


def test_non_action_tokens_never_reach_loss_or_gradient() -> None:
    logprobs = torch.tensor([[-0.1, -math.inf]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.2, -math.inf]], dtype=torch.float64)
    adv = torch.tensor([[1.0, math.nan]], dtype=torch.float64)
    mask = torch.tensor([[True, False]])
    loss, stats = ppo_clip_policy_loss(logprobs, old, adv, mask)
    loss.backward()
    assert math.isfinite(loss.item()) and logprobs.grad[0, 1].item() == 0.0
    assert math.isfinite(stats["ratio_mean"]) and stats["num_action_tokens"] == 1.0
    assert all(isinstance(v, torch.Tensor) and v.shape == () and v.dtype == torch.float64 for v in stats.values())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"clip_low": 0.0}, "clip_low"),
    ({"clip_low": 1.0}, "clip_low"),
    ({"clip_high": -0.1}, "clip_high"),
    ({"old_logprobs": torch.zeros(3)}, "old_logprobs"),
])
def test_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"logprobs": torch.zeros(1, 3), "old_logprobs": torch.zeros(1, 3), "advantages": torch.zeros(1, 3),
            "loss_mask": torch.ones(1, 3, dtype=torch.bool), **kwargs}
    with pytest.raises(ValueError, match=match):
        ppo_clip_policy_loss(**args)
