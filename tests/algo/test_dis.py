"""DIS policy loss: gradient identity, band edges, normalisation, statistics, validation.

Tolerances: float64 gradients match the closed form at rtol 1e-12; float32 at rtol 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_sao.algo import dis_policy_loss


def _batch(dtype: torch.dtype, seed: int = 0, shape: tuple[int, int] = (4, 30)) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rollout = -3.0 * torch.rand(shape, generator=gen, dtype=dtype)
    # log-ratios spread over [-1.5, 1.5]: rho from 0.22 to 4.5, both sides of a (0.3, 1.0) band.
    logprobs = (rollout + 3.0 * (torch.rand(shape, generator=gen, dtype=dtype) - 0.5)).requires_grad_()
    advantages = torch.randn(shape, generator=gen, dtype=dtype)
    mask = torch.rand(shape, generator=gen) < 0.7
    return {"logprobs": logprobs, "rollout_logprobs": rollout, "advantages": advantages, "loss_mask": mask,
            "eps_low": 0.3, "eps_high": 1.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradient_is_exactly_the_closed_form(dtype: torch.dtype) -> None:
    batch = _batch(dtype)
    loss, _ = dis_policy_loss(**batch)
    loss.backward()
    lp, mask = batch["logprobs"].detach(), batch["loss_mask"]
    rho = torch.exp(lp - batch["rollout_logprobs"])
    kept = mask & (rho > 0.7) & (rho < 2.0)
    assert 0 < int(kept.sum()) < int(mask.sum())  # the batch has tokens on both sides of the band
    expected = -(kept * rho * batch["advantages"]) / mask.sum()
    tol = {"rtol": 1e-12, "atol": 1e-15} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-8}
    torch.testing.assert_close(batch["logprobs"].grad, expected.to(dtype), **tol)
    # And the loss value is the detached-weight surrogate.
    torch.testing.assert_close(loss.detach(), -(kept * rho * batch["advantages"] * lp).sum() / mask.sum(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_band_edges_just_inside_and_just_outside(dtype: torch.dtype) -> None:
    eps_low, eps_high = 0.25, 1.0  # band (0.75, 2.0), both edges exactly representable
    step = 1e-5 if dtype == torch.float32 else 1e-9
    rho = torch.tensor([[0.75 * (1 - step), 0.75, 0.75 * (1 + step), 2.0 * (1 - step), 2.0, 2.0 * (1 + step)]],
                       dtype=torch.float64)
    rollout = torch.full_like(rho, -2.0)
    logprobs = (rollout + rho.log()).to(dtype).requires_grad_()
    advantages = torch.ones_like(logprobs)
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    loss, stats = dis_policy_loss(logprobs, rollout.to(dtype), advantages, mask, eps_low, eps_high)
    loss.backward()
    kept = (logprobs.grad != 0).tolist()[0]
    # Edges excluded: rho = 0.75 and rho = 2.0 are masked when exp(log(x)) rounds to x itself.
    computed = torch.exp(logprobs.detach() - rollout.to(dtype))[0].tolist()
    assert kept[0] is False and kept[2] is True and kept[3] is True and kept[5] is False
    assert kept[1] is (computed[1] > 0.75) and kept[4] is (computed[4] < 2.0)
    assert stats["num_masked_low"] == 1 + (computed[1] <= 0.75)
    assert stats["num_masked_high"] == 1 + (computed[4] >= 2.0)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_tokens_outside_band_get_no_gradient_whatever_the_advantage_sign(advantage: float) -> None:
    logprobs = torch.log(torch.tensor([[0.1, 1.0, 10.0]], dtype=torch.float64)).requires_grad_()
    loss, _ = dis_policy_loss(logprobs, torch.zeros(1, 3, dtype=torch.float64),
                              torch.full((1, 3), advantage, dtype=torch.float64),
                              torch.ones(1, 3, dtype=torch.bool), eps_low=0.5, eps_high=2.0)
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0, -advantage / 3, 0.0]]


def test_band_masked_tokens_stay_in_the_denominator() -> None:
    # Two action tokens, one far outside the band: the kept one is divided by 2, not 1.
    logprobs = torch.tensor([[math.log(1.0), math.log(50.0)]], dtype=torch.float64, requires_grad=True)
    loss, stats = dis_policy_loss(logprobs, torch.zeros(1, 2, dtype=torch.float64),
                                  torch.tensor([[3.0, 3.0]], dtype=torch.float64),
                                  torch.ones(1, 2, dtype=torch.bool), eps_low=0.3, eps_high=5.0)
    loss.backward()
    assert logprobs.grad.tolist() == [[-1.5, 0.0]]
    assert stats["masked_high_frac"] == 0.5 and stats["num_action_tokens"] == 2.0


def test_non_action_tokens_never_reach_loss_or_gradient() -> None:
    batch = _batch(torch.float64, seed=1)
    mask = batch["loss_mask"]
    logprobs = batch["logprobs"].detach().clone()
    logprobs[~mask] = -math.inf  # padding log-probs
    logprobs.requires_grad_()
    advantages = batch["advantages"].clone()
    advantages[~mask] = math.nan
    loss, stats = dis_policy_loss(logprobs, batch["rollout_logprobs"], advantages, mask, 0.3, 1.0)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logprobs.grad).all() and not logprobs.grad[~mask].any()
    assert math.isfinite(stats["ratio_mean"]) and math.isfinite(stats["ratio_max"])


def test_micro_batches_with_global_normaliser_sum_to_the_batch_loss_and_gradient() -> None:
    batch = _batch(torch.float64, seed=2, shape=(6, 25))
    full_loss, _ = dis_policy_loss(**batch)
    full_loss.backward()
    full_grad = batch["logprobs"].grad.clone()

    logprobs = batch["logprobs"].detach().clone().requires_grad_()
    total = batch["loss_mask"].sum()
    summed = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        part = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        part["logprobs"] = logprobs[rows]
        loss, _ = dis_policy_loss(**part, num_tokens=total)
        loss.backward()
        summed += loss.detach()
    torch.testing.assert_close(summed, full_loss.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(logprobs.grad, full_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("num_tokens", [None, 17, 17.0, torch.tensor(17), torch.tensor([17.0])])
def test_num_tokens_forms(num_tokens: object) -> None:
    batch = _batch(torch.float64, seed=3)
    loss, _ = dis_policy_loss(**batch, num_tokens=num_tokens)
    reference, _ = dis_policy_loss(**batch)
    count = int(batch["loss_mask"].sum()) if num_tokens is None else 17
    torch.testing.assert_close(loss * count, reference * int(batch["loss_mask"].sum()), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_loss_dtype(dtype: torch.dtype) -> None:
    batch = _batch(torch.float32, seed=4)
    batch["logprobs"] = batch["logprobs"].detach().to(dtype).requires_grad_()
    loss, _ = dis_policy_loss(**batch)
    assert loss.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    loss.backward()
    assert batch["logprobs"].grad.dtype == dtype


def test_statistics() -> None:
    rho = torch.tensor([[0.5, 0.9, 1.0, 1.2, 7.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, True, False]])
    _, stats = dis_policy_loss(rho.log(), torch.zeros_like(rho), torch.ones_like(rho), mask, 0.3, 5.0)
    assert stats["num_action_tokens"] == 5.0
    assert stats["masked_low_frac"] == pytest.approx(1 / 5)
    assert stats["masked_high_frac"] == pytest.approx(1 / 5)
    assert stats["masked_frac"] == pytest.approx(2 / 5)
    assert stats["ratio_mean"] == pytest.approx((0.5 + 0.9 + 1.0 + 1.2 + 7.0) / 5)
    assert stats["ratio_min"] == pytest.approx(0.5) and stats["ratio_max"] == pytest.approx(7.0)
    k3 = sum(r - 1 - math.log(r) for r in (0.5, 0.9, 1.0, 1.2, 7.0)) / 5
    assert stats["kl_k3"] == pytest.approx(k3)
    # 0-dim float64 tensors on the inputs' device: nothing in the loss waits for the device.
    assert all(isinstance(v, torch.Tensor) and v.shape == () and v.dtype == torch.float64 and v.device == rho.device
               for v in stats.values())


def test_no_action_tokens_gives_zero_loss_and_nan_ratio_stats() -> None:
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, stats = dis_policy_loss(logprobs, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool),
                                  0.3, 5.0)
    loss.backward()
    assert loss.item() == 0.0 and not logprobs.grad.any()
    assert stats["masked_low_frac"] == 0.0 and stats["num_action_tokens"] == 0.0
    assert math.isnan(stats["ratio_mean"])
    empty_loss, _ = dis_policy_loss(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4),
                                    torch.zeros(0, 4, dtype=torch.bool), 0.3, 5.0)
    assert empty_loss.item() == 0.0


@pytest.mark.parametrize(("override", "match"), [
    ({"eps_low": 0.0}, "eps_low"),
    ({"eps_low": 1.0}, "eps_low"),
    ({"eps_low": -0.2}, "eps_low"),
    ({"eps_high": 0.0}, "eps_high"),
    ({"num_tokens": 0}, "num_tokens"),
    ({"num_tokens": torch.tensor([1.0, 2.0])}, "num_tokens"),
    ({"loss_mask": torch.ones(2, 3)}, "loss_mask"),
    ({"advantages": torch.zeros(3, 2)}, "advantages"),
    ({"rollout_logprobs": torch.zeros(2, 3, dtype=torch.long)}, "rollout_logprobs"),
])
def test_rejects_bad_arguments(override: dict, match: str) -> None:
    args = {"logprobs": torch.zeros(2, 3), "rollout_logprobs": torch.zeros(2, 3), "advantages": torch.zeros(2, 3),
            "loss_mask": torch.ones(2, 3, dtype=torch.bool), "eps_low": 0.3, "eps_high": 5.0, **override}
    with pytest.raises(ValueError, match=match):
        dis_policy_loss(**args)


def test_nan_ratio_is_not_kept() -> None:
    logprobs = torch.tensor([[math.nan, 0.0]], dtype=torch.float64, requires_grad=True)
    zeros, ones = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    loss, stats = dis_policy_loss(logprobs, zeros, ones, torch.ones(1, 2, dtype=torch.bool), 0.3, 5.0)
    loss.backward()
    assert loss.item() == 0.0 and logprobs.grad.tolist() == [[0.0, -0.5]]
    assert stats["num_masked_low"] == 0.0 and stats["num_masked_high"] == 0.0


def test_advantages_are_detached() -> None:
    """Advantages that carry gradient (a critic's output) must get none from the policy loss:
    only `logprobs` is differentiated."""
    batch = _batch(torch.float64)
    batch["advantages"] = batch["advantages"].clone().requires_grad_()
    loss, _ = dis_policy_loss(**batch)
    loss.backward()
    assert batch["advantages"].grad is None or torch.count_nonzero(batch["advantages"].grad) == 0
    assert batch["logprobs"].grad is not None and torch.count_nonzero(batch["logprobs"].grad) > 0
