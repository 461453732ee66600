"""The `longtail` benchmark environment: seeded lognormal episode lengths, in start order, and a
reward that depends on what the model wrote."""

from __future__ import annotations

import asyncio
import math
import random
import statistics

import pytest

from megatron_sao.rollout.environment import PromptSample
from megatron_sao.rollout.envs import make_env_factory, registered_environments
from megatron_sao.rollout.envs.longtail import LongTailConfig, draw_turns, turn_quantiles

SAMPLE = PromptSample(prompt_id="p0", messages=[{"role": "user", "content": "go"}])


async def _episode(env, actions: list[str]) -> list:
    await env.reset(SAMPLE)
    results = []
    for action in actions:
        results.append(await env.step(action))
        if results[-1].done:
            break
    return results


def test_episodes_last_their_drawn_number_of_turns_in_factory_order() -> None:
    assert "longtail" in registered_environments()
    kwargs = {"turns_median": 4, "turns_sigma": 1.0, "max_turns": 30, "seed": 7}
    factory = make_env_factory("longtail", **kwargs)
    rng = random.Random(7)
    config = LongTailConfig(**kwargs)
    for _ in range(20):
        expected = draw_turns(config, rng)
        rng.getrandbits(32)  # the factory draws the episode's observation seed next
        results = asyncio.run(_episode(factory(SAMPLE), ["12ab"] * 40))
        assert len(results) == expected
        assert all(not r.done and len(r.observation) == 8 for r in results[:-1])
        assert results[-1].done and not results[-1].truncated
        assert results[-1].reward == pytest.approx(0.5)  # half of the characters are digits


def test_lengths_follow_the_documented_lognormal() -> None:
    config = LongTailConfig(turns_median=5, turns_sigma=0.8, max_turns=10_000)
    rng = random.Random(0)
    draws = [draw_turns(config, rng) for _ in range(20_000)]
    q = turn_quantiles(config)
    assert statistics.median(draws) == pytest.approx(q["median"], abs=1)
    assert statistics.fmean(draws) == pytest.approx(q["mean"], rel=0.05)
    assert sorted(draws)[int(0.99 * len(draws))] == pytest.approx(q["p99"], rel=0.1)
    assert q["p99"] == pytest.approx(5 * math.exp(2.326 * 0.8))


def test_clamp_and_zero_variance() -> None:
    rng = random.Random(1)
    assert {draw_turns(LongTailConfig(turns_median=3, turns_sigma=0.0), rng) for _ in range(50)} == {3}
    clamped = [draw_turns(LongTailConfig(turns_median=50, turns_sigma=2.0, max_turns=8), rng) for _ in range(200)]
    assert max(clamped) == 8 and min(clamped) >= 1


@pytest.mark.parametrize("field,value", [("turns_median", 0.5), ("turns_sigma", -1), ("max_turns", 0),
                                         ("observation_chars", -1)])
def test_bad_settings_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        make_env_factory("longtail", **{field: value})
