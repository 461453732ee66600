"""reporting/heldout_noise.py: the noise on a held-out gain, pooled and per difficulty tier."""

from __future__ import annotations

import math
import random

import pytest

from megatron_sao.reporting.heldout_noise import evaluation_sd, per_tier_noise, pooled_noise


def test_one_policys_evaluation_sd():
    assert evaluation_sd({"a": 0.5, "b": 0.0, "all": 0.25}, {"a": 100, "b": 100}) == pytest.approx(math.sqrt(25) / 200)


def test_one_tier_is_the_pooled_value():
    assert per_tier_noise({"t": 0.6}, {"t": 0.7}, {"t": 1024}) == pytest.approx(pooled_noise(0.6, 0.7, 1024))
    assert pooled_noise(0.5, 0.5, 1024) == pytest.approx(1.96 * math.sqrt(0.5 / 1024))


def test_an_unsolved_tier_adds_nothing_and_the_bound_holds_by_simulation():
    rates_a = {"easy": 0.85, "mid": 0.7, "never": 0.0}
    rates_b = {"easy": 0.9, "mid": 0.78, "never": 0.0}
    counts = {"easy": 300, "mid": 300, "never": 300}
    noise = per_tier_noise(rates_a, rates_b, counts)
    without = per_tier_noise({k: rates_a[k] for k in ("easy", "mid")}, {k: rates_b[k] for k in ("easy", "mid")},
                             {"easy": 300, "mid": 300})
    assert noise == pytest.approx(without * 600 / 900)  # same variance, spread over more prompts
    overall_a = sum(rates_a[t] * n for t, n in counts.items()) / 900
    overall_b = sum(rates_b[t] * n for t, n in counts.items()) / 900
    assert noise < 0.75 * pooled_noise(overall_a, overall_b, 900)
    rng = random.Random(0)  # 1.96 sd of simulated gains on these prompts: the per-tier value, not the pooled one
    gains = []
    for _ in range(3000):
        solved = [sum(rng.random() < rates_b[t] for _ in range(n)) - sum(rng.random() < rates_a[t] for _ in range(n))
                  for t, n in counts.items()]
        gains.append(sum(solved) / 900)
    mean = sum(gains) / len(gains)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gains) / (len(gains) - 1))
    assert 1.96 * sd == pytest.approx(noise, rel=0.06)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"no success rate for tier\(s\) \['t3'\]"):
        per_tier_noise({"t0": 0.5}, {"t0": 0.6, "t3": 0.0}, {"t0": 10, "t3": 10})
    with pytest.raises(ValueError, match="no prompts in"):
        evaluation_sd({"t0": 0.5}, {"t0": 0})
    with pytest.raises(ValueError, match="num_prompts must be positive"):
        pooled_noise(0.5, 0.5, 0)
