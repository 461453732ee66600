"""The evaluation's noise on a held-out gain: how far apart two policies' success rates on the
same prompts can land by sampling alone (`sao demo`'s last lines, tools/demo_runs/summarize.py).

Each policy answers every prompt once, so its success rate is a mean of Bernoulli draws. Two
estimates of that noise, each 1.96 x the sd of the difference of the two rates:

    pooled    every prompt treated as one draw at the overall rate, the two rates independent:
              sqrt(p_a(1-p_a)/N + p_b(1-p_b)/N). An upper bound when prompts differ in difficulty.
    per tier  the draws grouped by difficulty tier (the calc task's `metadata["tier"]`), which the
              prompts name: sum over tiers of n_t (p_a,t(1-p_a,t) + p_b,t(1-p_b,t)) / N^2. With
              one tier it is the pooled value; a tier nobody solves adds nothing, as it should.
              Still an upper bound on the noise over these prompts (prompts within a tier differ
              too), and it leaves out the prompts' own sampling, which the two policies share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

Z = 1.96
"""Two-sided 95% for a normal approximation."""


def pooled_noise(rate_a: float, rate_b: float, num_prompts: int) -> float:
    if num_prompts <= 0:
        raise ValueError(f"pooled_noise: num_prompts must be positive, got {num_prompts}")
    return Z * math.sqrt((rate_a * (1 - rate_a) + rate_b * (1 - rate_b)) / num_prompts)


def evaluation_sd(rates: Mapping[str, float], counts: Mapping[str, int]) -> float:
    """The sd of one policy's success rate from its evaluation's sampling alone, per tier:
    sqrt(sum over tiers of n_t p_t (1 - p_t)) / N. `rates`: success per tier (extra keys such as
    `all` are ignored); `counts`: prompts per tier."""
    missing = sorted(set(counts) - set(rates))
    if missing:
        raise ValueError(f"no success rate for tier(s) {missing}")
    total = sum(counts.values())
    if total <= 0:
        raise ValueError(f"no prompts in {dict(counts)}")
    return math.sqrt(sum(n * rates[t] * (1 - rates[t]) for t, n in counts.items())) / total


def per_tier_noise(rates_a: Mapping[str, float], rates_b: Mapping[str, float], counts: Mapping[str, int]) -> float:
    """1.96 sd of the difference of two policies' success rates on the same prompts, per tier."""
    return Z * math.hypot(evaluation_sd(rates_a, counts), evaluation_sd(rates_b, counts))
