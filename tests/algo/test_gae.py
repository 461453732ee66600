"""Skip-observation GAE: the contract of `skip_observation_gae`, one behaviour per test.

Tolerances: float64 comparisons use rtol = atol = 1e-12 (both sides accumulate in float64, they
differ only in summation order); float32 outputs are compared to float64 at rtol 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

import megatron_sao.algo.gae as gae_module
from megatron_sao.algo import length_adaptive_lambda, skip_observation_gae, skip_observation_gae_reference
from tests.algo.helpers import random_turn_batch, textbook_gae, turn_mask

F64 = {"rtol": 1e-12, "atol": 1e-12}


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (1.0, 0.0), (0.5, 0.3), (0.0, 1.0)])
def test_equals_textbook_gae_without_observation_tokens(gamma: float, lam: float) -> None:
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(3, 70, generator=gen, dtype=torch.float64)
    values = torch.randn(3, 70, generator=gen, dtype=torch.float64)
    mask = torch.ones(3, 70, dtype=torch.bool)
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=gamma, lam=lam)
    expected = torch.tensor([textbook_gae(r.tolist(), v.tolist(), gamma, lam) for r, v in zip(rewards, values,
                                                                                                strict=True)],
                            dtype=torch.float64)
    torch.testing.assert_close(adv, expected, **F64)
    torch.testing.assert_close(ret, expected + values, **F64)


def test_equals_reference_loop_on_multi_turn_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    rewards, values, mask = random_turn_batch(8, 400, turns=12, gen=gen)
    lam = length_adaptive_lambda(mask.sum(1))
    fast = skip_observation_gae(rewards, values, mask, gamma=0.998, lam=lam)
    ref = skip_observation_gae_reference(rewards, values, mask, gamma=0.998, lam=lam)
    for got, want in zip(fast, ref, strict=True):
        torch.testing.assert_close(got, want, **F64)


def test_action_spans_bridge_observations_to_next_action() -> None:
    # [a a][o o o][a]: the last token of span 0 bootstraps from the first token of span 1.
    mask = torch.tensor([[True, True, False, False, False, True]])
    values = torch.tensor([[0.1, 0.3, 9.0, 9.0, 9.0, 0.7]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    adv, _ = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.0)
    expected = torch.tensor([[0.3 - 0.1, 0.7 - 0.3, 0, 0, 0, 1.0 - 0.7]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, **F64)


@pytest.mark.parametrize("seed", range(4))
def test_invariant_to_inserted_observation_tokens(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_actions = 40
    rewards_k = torch.randn(num_actions, generator=gen, dtype=torch.float64)
    values_k = torch.randn(num_actions, generator=gen, dtype=torch.float64)
    # Insert 0..60 observation tokens (zero reward, arbitrary value) before every action token.
    gaps = torch.randint(0, 61, (num_actions + 1,), generator=gen).tolist()
    num_tokens = num_actions + sum(gaps)
    mask = torch.zeros(1, num_tokens, dtype=torch.bool)
    rewards = torch.zeros(1, num_tokens, dtype=torch.float64)
    values = 1e6 * torch.randn(1, num_tokens, generator=gen, dtype=torch.float64)
    cols = torch.tensor(gaps[:-1]).cumsum(0) + torch.arange(num_actions)
    mask[0, cols], rewards[0, cols], values[0, cols] = True, rewards_k, values_k
    lam = torch.tensor([0.9], dtype=torch.float64)

    adv, ret = skip_observation_gae(rewards, values, mask, gamma=0.97, lam=lam)
    adv_k, ret_k = skip_observation_gae(rewards_k[None], values_k[None], torch.ones(1, num_actions, dtype=torch.bool),
                                        gamma=0.97, lam=lam)
    torch.testing.assert_close(adv[mask], adv_k[0], **F64)
    torch.testing.assert_close(ret[mask], ret_k[0], **F64)
    assert bool((adv[~mask] == 0).all()) and bool((ret[~mask] == 0).all())


@pytest.mark.parametrize("tail", ["observation", "eos_padding", "padding"])
def test_reward_after_last_action_token_is_credited_to_it(tail: str) -> None:
    mask = turn_mask([[3, 2, 2]], num_tokens=12)  # actions at 0-2 and 5-6, then tokens 7-11
    values = torch.linspace(0.1, 1.2, 12, dtype=torch.float64)[None]
    position = {"observation": 7, "eos_padding": 8, "padding": 11}[tail]
    moved = torch.zeros(1, 12, dtype=torch.float64)
    moved[0, position] = 1.0
    on_action = torch.zeros(1, 12, dtype=torch.float64)
    on_action[0, 6] = 1.0
    got = skip_observation_gae(moved, values, mask, gamma=0.9, lam=0.8)
    want = skip_observation_gae(on_action, values, mask, gamma=0.9, lam=0.8)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **F64)


def test_reward_on_observation_counts_at_preceding_action_token() -> None:
    mask = turn_mask([[2, 3, 2]], num_tokens=7)  # actions 0-1, observation 2-4, actions 5-6
    values = torch.zeros(1, 7, dtype=torch.float64)
    rewards = torch.zeros(1, 7, dtype=torch.float64)
    rewards[0, 3] = 0.5
    adv, _ = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.0)
    # lam = 0 and V = 0: the advantage is each action token's own credited reward.
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5, 0, 0, 0, 0, 0]], dtype=torch.float64), **F64)


def test_reward_before_first_action_token_is_ignored() -> None:
    mask = turn_mask([[3]], num_tokens=6, prompt=2)
    values = torch.rand(1, 6, dtype=torch.float64)
    with_prompt_reward = torch.zeros(1, 6, dtype=torch.float64)
    with_prompt_reward[0, 1] = 5.0
    got = skip_observation_gae(with_prompt_reward, values, mask, gamma=1.0, lam=1.0)
    want = skip_observation_gae(torch.zeros(1, 6, dtype=torch.float64), values, mask, gamma=1.0, lam=1.0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **F64)


def test_per_row_lambda_equals_rows_run_separately() -> None:
    gen = torch.Generator().manual_seed(2)
    rewards, values, mask = random_turn_batch(4, 150, turns=6, gen=gen)
    lam = torch.tensor([0.0, 0.5, 0.93, 1.0], dtype=torch.float64)
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=0.99, lam=lam)
    for b in range(4):
        adv_b, ret_b = skip_observation_gae(rewards[b:b + 1], values[b:b + 1], mask[b:b + 1], gamma=0.99,
                                            lam=float(lam[b]))
        torch.testing.assert_close(adv[b:b + 1], adv_b, **F64)
        torch.testing.assert_close(ret[b:b + 1], ret_b, **F64)


def _credited_rewards_and_values(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                                 b: int) -> tuple[list[int], list[float], list[float]]:
    """Action columns of row b, the reward credited to each (plain Python), and their values."""
    cols = [t for t in range(mask.shape[1]) if mask[b, t]]
    credited = [float(rewards[b, t:(cols[i + 1] if i + 1 < len(cols) else mask.shape[1])].sum())
                for i, t in enumerate(cols)]
    return cols, credited, [float(values[b, t]) for t in cols]


@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_lambda_zero_gives_one_step_td_error(gamma: float) -> None:
    gen = torch.Generator().manual_seed(3)
    rewards, values, mask = random_turn_batch(3, 60, turns=4, gen=gen)
    adv, _ = skip_observation_gae(rewards, values, mask, gamma=gamma, lam=0.0)
    expected = torch.zeros_like(adv)
    for b in range(3):
        cols, credited, vals = _credited_rewards_and_values(rewards, values, mask, b)
        for k, t in enumerate(cols):
            next_value = vals[k + 1] if k + 1 < len(cols) else 0.0
            expected[b, t] = credited[k] + gamma * next_value - vals[k]
    torch.testing.assert_close(adv, expected, **F64)


def test_gamma_one_lambda_one_gives_reward_to_go_minus_value() -> None:
    gen = torch.Generator().manual_seed(10)
    rewards, values, mask = random_turn_batch(3, 80, turns=5, gen=gen)
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    for b in range(3):
        cols, credited, vals = _credited_rewards_and_values(rewards, values, mask, b)
        to_go = [sum(credited[k:]) for k in range(len(cols))]
        torch.testing.assert_close(ret[b, cols], torch.tensor(to_go, dtype=torch.float64), **F64)
        torch.testing.assert_close(adv[b, cols], torch.tensor(to_go, dtype=torch.float64) - torch.tensor(vals,
                                   dtype=torch.float64), **F64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_is_preserved_and_float32_agrees_with_float64(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    rewards, values, mask = random_turn_batch(3, 300, turns=10, gen=gen)
    want_adv, want_ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.95)
    adv, ret = skip_observation_gae(rewards.to(dtype), values.to(dtype), mask, gamma=1.0, lam=0.95)
    assert adv.dtype == dtype and ret.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else F64
    torch.testing.assert_close(adv.double(), want_adv, **tol)
    torch.testing.assert_close(ret.double(), want_ret, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_returns_are_exactly_advantages_plus_values_and_zero_off_action(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    rewards, values, mask = random_turn_batch(4, 200, turns=8, gen=gen, dtype=dtype)
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=0.99, lam=0.9)
    assert torch.equal(ret[mask], adv[mask] + values[mask])
    assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))
    assert torch.equal(ret[~mask], torch.zeros_like(ret[~mask]))


def test_rows_without_action_tokens_are_all_zero() -> None:
    gen = torch.Generator().manual_seed(6)
    rewards, values, mask = random_turn_batch(4, 50, turns=3, gen=gen)
    mask[1] = False
    mask[3] = False
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.9)
    assert not adv[[1, 3]].any() and not ret[[1, 3]].any()
    ref_adv, ref_ret = skip_observation_gae_reference(rewards, values, mask, gamma=1.0, lam=0.9)
    torch.testing.assert_close(adv, ref_adv, **F64)
    torch.testing.assert_close(ret, ref_ret, **F64)


@pytest.mark.parametrize("shape", [(3, 0), (0, 5), (0, 0), (2, 7)])
def test_empty_batches(shape: tuple[int, int]) -> None:
    mask = torch.zeros(shape, dtype=torch.bool)
    adv, ret = skip_observation_gae(torch.ones(shape), torch.ones(shape), mask)
    assert adv.shape == shape and ret.shape == shape
    assert not adv.any() and not ret.any()


def test_long_row_with_small_lambda_stays_finite_and_exact() -> None:
    # 5,000 action tokens need three scan levels; c = 0.05 would overflow any c^-k formulation.
    gen = torch.Generator().manual_seed(7)
    rewards = torch.randn(2, 5000, generator=gen, dtype=torch.float64)
    values = torch.randn(2, 5000, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, 5000, dtype=torch.bool)
    mask[1, ::7] = False
    lam = torch.tensor([0.05, 1.0], dtype=torch.float64)
    fast = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=lam)
    ref = skip_observation_gae_reference(rewards, values, mask, gamma=1.0, lam=lam)
    for got, want in zip(fast, ref, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_result_does_not_depend_on_row_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(8)
    rewards, values, mask = random_turn_batch(6, 120, turns=5, gen=gen)
    whole = skip_observation_gae(rewards, values, mask, gamma=0.99, lam=0.9)
    monkeypatch.setattr(gae_module, "_CPU_CHUNK_ELEMENTS", 1)  # one row per chunk
    chunked = skip_observation_gae(rewards, values, mask, gamma=0.99, lam=0.9)
    for got, want in zip(chunked, whole, strict=True):
        torch.testing.assert_close(got, want, **F64)


def test_non_contiguous_inputs() -> None:
    gen = torch.Generator().manual_seed(9)
    rewards, values, mask = random_turn_batch(5, 90, turns=4, gen=gen)
    got = skip_observation_gae(rewards.t().contiguous().t(), values[:, :], mask.t().contiguous().t(), lam=0.8)
    want = skip_observation_gae(rewards, values, mask, lam=0.8)
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous()
        torch.testing.assert_close(g, w, **F64)


def test_builds_no_autograd_graph() -> None:
    values = torch.randn(2, 10, dtype=torch.float64, requires_grad=True)
    adv, ret = skip_observation_gae(torch.zeros(2, 10, dtype=torch.float64), values,
                                    torch.ones(2, 10, dtype=torch.bool))
    assert not adv.requires_grad and not ret.requires_grad


def test_length_adaptive_lambda() -> None:
    lam = length_adaptive_lambda(torch.tensor([0, 1, 2, 3, 100_000]))
    assert lam.dtype == torch.float64
    expected = [0.0, 1 - 1 / 1.5, 1 - 1 / 3.0, 1 - 1 / 4.5, 1 - 1 / 150_000]
    assert lam.tolist() == pytest.approx(expected, rel=1e-15, abs=0)
    # alpha < 1 would make lambda negative for l = 1: clamped to 0.
    assert length_adaptive_lambda(torch.tensor([1, 4]), alpha=0.5).tolist() == [0.0, 0.5]
    assert math.isclose(float(length_adaptive_lambda(torch.tensor([10.0]), alpha=2.0)[0]), 0.95)
    # Fractional lengths follow the formula too (0 < alpha * l < 1 clamps to 0).
    assert length_adaptive_lambda(torch.tensor([0.5, 4.0]), alpha=1.0).tolist() == [0.0, 0.75]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"alpha": 0.0}, "alpha"),
    ({"num_action_tokens": torch.tensor([[1, 2]])}, "num_action_tokens"),
    ({"num_action_tokens": torch.tensor([-1])}, "num_action_tokens"),
])
def test_length_adaptive_lambda_rejects_bad_input(kwargs: dict, match: str) -> None:
    args = {"num_action_tokens": torch.tensor([3]), **kwargs}
    with pytest.raises(ValueError, match=match):
        length_adaptive_lambda(**args)


def _good() -> dict:
    return {"rewards": torch.zeros(2, 4), "values": torch.zeros(2, 4), "loss_mask": torch.ones(2, 4, dtype=torch.bool)}


@pytest.mark.parametrize(("override", "match"), [
    ({"loss_mask": torch.ones(2, 4)}, "loss_mask"),
    ({"loss_mask": torch.ones(8, dtype=torch.bool)}, "loss_mask"),
    ({"rewards": torch.zeros(2, 5)}, "rewards"),
    ({"values": torch.zeros(4, 2)}, "values"),
    ({"values": torch.zeros(2, 4, dtype=torch.float64)}, "values"),
    ({"rewards": torch.zeros(2, 4, dtype=torch.bfloat16), "values": torch.zeros(2, 4, dtype=torch.bfloat16)},
     "rewards"),
    ({"gamma": 1.5}, "gamma"),
    ({"lam": -0.1}, "lam"),
    ({"lam": torch.tensor([0.5, 1.2])}, "lam"),
    ({"lam": torch.tensor([0.5, 0.5, 0.5])}, "lam"),
])
def test_rejects_bad_arguments(override: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        skip_observation_gae(**{**_good(), **override})
    with pytest.raises(ValueError, match=match):
        skip_observation_gae_reference(**{**_good(), **override})
