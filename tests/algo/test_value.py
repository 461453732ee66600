"""Critic loss and explained variance. Tolerances: float64 at rtol 1e-12 unless stated."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_sao.algo import (
    explained_variance,
    explained_variance_from_moments,
    explained_variance_moments,
    return_variance_from_moments,
    value_loss,
)


def _batch(seed: int = 0, shape: tuple[int, int] = (4, 20)) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "values": torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_(),
        "returns": torch.randn(shape, generator=gen, dtype=torch.float64),
        "loss_mask": torch.rand(shape, generator=gen) < 0.6,
        "old_values": torch.randn(shape, generator=gen, dtype=torch.float64),
    }


def test_plain_mse_over_action_tokens_and_its_gradient() -> None:
    batch = _batch()
    values, returns, mask = batch["values"], batch["returns"], batch["loss_mask"]
    loss, stats = value_loss(values, returns, mask)
    loss.backward()
    n = mask.sum()
    err = (values.detach() - returns)[mask]
    torch.testing.assert_close(loss.detach(), err.square().sum() / n, rtol=1e-12, atol=0)
    torch.testing.assert_close(values.grad, 2 * (values.detach() - returns) * mask / n, rtol=1e-12, atol=1e-15)
    assert stats["clip_frac"] == 0.0
    assert stats["mse"] == pytest.approx(float(err.square().mean()))
    assert stats["value_mean"] == pytest.approx(float(values.detach()[mask].mean()))
    assert stats["return_mean"] == pytest.approx(float(returns[mask].mean()))
    assert stats["explained_variance"] == pytest.approx(explained_variance(values.detach(), returns, mask))
    assert all(isinstance(v, torch.Tensor) and v.shape == () and v.dtype == torch.float64 for v in stats.values())


def test_clipped_loss_takes_the_larger_error_per_token() -> None:
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.1, -0.5, 0.5]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, stats = value_loss(values, returns, mask, old_values=old, clip_range=0.2)
    loss.backward()
    # token 0: V moved 0.5 toward R; clipped V = 0.2 is further from R -> (0.2 - 1)^2, no gradient.
    # token 1: inside the clip range -> (0.1 - 1)^2.
    # token 2: moved away from R; clipped V = -0.2 is closer -> unclipped (-0.5 - 1)^2 wins.
    # token 3: moved away from R = -1; clipped 0.2 closer -> unclipped (0.5 + 1)^2.
    expected = ((0.2 - 1) ** 2 + (0.1 - 1) ** 2 + 1.5**2 + 1.5**2) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert values.grad[0].tolist() == pytest.approx([0.0, 2 * (0.1 - 1) / 4, 2 * -1.5 / 4, 2 * 1.5 / 4], rel=1e-12)
    assert stats["clip_frac"] == pytest.approx(0.25)


def test_micro_batches_with_global_normaliser_sum_to_the_batch_loss_and_gradient() -> None:
    batch = _batch(seed=1, shape=(6, 15))
    full, _ = value_loss(**batch, clip_range=0.3)
    full.backward()
    values = batch["values"].detach().clone().requires_grad_()
    total = batch["loss_mask"].sum()
    summed = 0.0
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        loss, _ = value_loss(values[rows], batch["returns"][rows], batch["loss_mask"][rows],
                             batch["old_values"][rows], clip_range=0.3, num_tokens=total)
        loss.backward()
        summed += loss.item()
    assert summed == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(values.grad, batch["values"].grad, rtol=1e-12, atol=1e-15)


def test_non_action_tokens_are_ignored() -> None:
    batch = _batch(seed=2)
    returns = batch["returns"].clone()
    returns[~batch["loss_mask"]] = math.nan
    loss, stats = value_loss(batch["values"], returns, batch["loss_mask"])
    loss.backward()
    assert torch.isfinite(loss) and not batch["values"].grad[~batch["loss_mask"]].any()
    assert math.isfinite(stats["explained_variance"])


def test_float32_and_bfloat16_predictions() -> None:
    batch = _batch(seed=3)
    for dtype, loss_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32)):
        values = batch["values"].detach().to(dtype).requires_grad_()
        loss, _ = value_loss(values, batch["returns"].to(dtype), batch["loss_mask"])
        assert loss.dtype == loss_dtype
        loss.backward()
        assert values.grad.dtype == dtype


def test_explained_variance() -> None:
    gen = torch.Generator().manual_seed(4)
    returns = torch.randn(3, 50, generator=gen, dtype=torch.float64)
    mask = torch.rand(3, 50, generator=gen) < 0.5
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    mean_only = torch.full_like(returns, float(returns[mask].mean()))
    assert explained_variance(mean_only, returns, mask) == pytest.approx(0.0, abs=1e-12)
    values = returns + 0.5 * torch.randn(3, 50, generator=gen, dtype=torch.float64)
    values[~mask] = 1e9  # ignored
    r, v = returns[mask], values[mask]
    expected = 1 - float((r - v).var(unbiased=False) / r.var(unbiased=False))
    assert explained_variance(values, returns, mask) == pytest.approx(expected, rel=1e-12)


def test_explained_variance_is_nan_when_undefined() -> None:
    mask = torch.ones(1, 4, dtype=torch.bool)
    constant = torch.full((1, 4), 0.1, dtype=torch.float64)
    assert math.isnan(explained_variance(torch.zeros(1, 4), constant.float(), mask))
    assert math.isnan(explained_variance(torch.zeros(1, 4), torch.randn(1, 4), torch.zeros(1, 4, dtype=torch.bool)))
    assert math.isnan(explained_variance_from_moments(explained_variance_moments(constant, constant, mask)))


def test_explained_variance_is_nan_below_the_return_variance_threshold() -> None:
    """31 returns of 1.0 and one of 0.9 (variance 3e-4): the critic's EV would be any number
    (here about -30 for values that miss by +-0.1); with a threshold above that variance it is NaN,
    and a batch with real spread is still reported."""
    mask = torch.ones(32, 1, dtype=torch.bool)
    returns = torch.ones(32, 1, dtype=torch.float64)
    returns[0] = 0.9
    values = returns + 0.1 * torch.tensor([(-1.0) ** i for i in range(32)], dtype=torch.float64)[:, None]
    moments = explained_variance_moments(values, returns, mask)
    assert explained_variance_from_moments(moments) < -20
    assert math.isnan(explained_variance_from_moments(moments, min_return_var=1e-3))
    assert math.isnan(explained_variance(values, returns, mask, min_return_var=1e-3))
    assert return_variance_from_moments(moments) == pytest.approx(31 / 32**2 * 0.01)
    spread = torch.linspace(0, 1, 32, dtype=torch.float64)[:, None]
    assert explained_variance(spread, spread, mask, min_return_var=1e-3) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="min_return_var"):
        explained_variance(spread, spread, mask, min_return_var=-1.0)


def test_moments_summed_over_micro_batches_give_the_batch_explained_variance() -> None:
    gen = torch.Generator().manual_seed(5)
    returns = torch.randn(6, 40, generator=gen, dtype=torch.float64) + 0.5
    values = returns + 0.3 * torch.randn(6, 40, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 40, generator=gen) < 0.5
    moments = sum(explained_variance_moments(values[rows], returns[rows], mask[rows])
                  for rows in (slice(0, 1), slice(1, 4), slice(4, 6)))
    assert explained_variance_from_moments(moments) == pytest.approx(explained_variance(values, returns, mask),
                                                                     rel=1e-10)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"clip_range": 0.2}, "old_values"),
    ({"clip_range": 0.0, "old_values": torch.zeros(2, 3)}, "clip_range"),
    ({"returns": torch.zeros(3, 2)}, "returns"),
    ({"old_values": torch.zeros(2, 2)}, "old_values"),
    ({"num_tokens": -1}, "num_tokens"),
])
def test_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"values": torch.zeros(2, 3), "returns": torch.zeros(2, 3), "loss_mask": torch.ones(2, 3, dtype=torch.bool),
            **kwargs}
    with pytest.raises(ValueError, match=match):
        value_loss(**args)


def test_from_moments_rejects_wrong_shape() -> None:
    with pytest.raises(ValueError, match="moments"):
        explained_variance_from_moments(torch.zeros(4))
