"""A benchmark environment with long-tailed episode lengths (`tools/bench_async.py`).

Agentic rollouts are long-tailed: most episodes take a few turns, a few take a hundred. That tail
is what makes a synchronous batch wait (SAO_METHOD, "Why"), so the async-vs-sync benchmark needs
it under control: this environment decides how many assistant turns an episode lasts, whatever
the model says, from a seeded lognormal.

Episode i, in the order the factory makes them (the order trajectories start), ends after

    N_i = min(max_turns, max(1, round(turns_median * exp(turns_sigma * z_i)))),   z_i ~ N(0, 1)

assistant turns (`random.Random(seed)` draws the z_i): median `turns_median`, mean
`turns_median * exp(turns_sigma**2 / 2)` and 99th percentile `turns_median * exp(2.326 *
turns_sigma)` before the clamp (`turn_quantiles`). Every turn but the last gets an observation of
`observation_chars` characters; the last ends the episode (COMPLETED). Tokens per turn are the
model's business: an action ends at the stop token or at the agent loop's turn limit (then the
loop truncates the episode; TRUNCATED trajectories are still trained on).

The terminal reward is the share of digit characters among the actions' characters: it depends on
what the model samples, so advantages are not all zero and the trainer does real work, but it is
not a task anyone should expect a model to learn from.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from megatron_sao.rollout.environment import Environment, PromptSample, StepResult

Z_P99 = 2.326  # the standard normal's 99th percentile


@dataclass(kw_only=True, slots=True)
class LongTailConfig:
    turns_median: float = 3.0
    """Median of the lognormal number of assistant turns per episode."""
    turns_sigma: float = 1.0
    """Shape of the lognormal (the sigma of log N): 1.0 puts the 99th percentile ~10x the median."""
    max_turns: int = 64
    """Clamp on the drawn turn count (set the agent loop's max_turns at least this high)."""
    observation_chars: int = 8
    """Length of each observation (digits), which the engine prefills on the next turn."""
    seed: int = 0
    """Seed of the draws: the same seed gives the same sequence of episode lengths."""

    def __post_init__(self) -> None:
        if self.turns_median < 1:
            raise ValueError(f"longtail turns_median must be >= 1, got {self.turns_median}")
        if self.turns_sigma < 0:
            raise ValueError(f"longtail turns_sigma must be >= 0, got {self.turns_sigma}")
        if self.max_turns < 1:
            raise ValueError(f"longtail max_turns must be >= 1, got {self.max_turns}")
        if self.observation_chars < 0:
            raise ValueError(f"longtail observation_chars must be >= 0, got {self.observation_chars}")


def draw_turns(config: LongTailConfig, rng: random.Random) -> int:
    """One episode's number of assistant turns (see the module docstring)."""
    turns = round(config.turns_median * math.exp(config.turns_sigma * rng.gauss(0.0, 1.0)))
    return min(config.max_turns, max(1, turns))


def turn_quantiles(config: LongTailConfig) -> dict[str, float]:
    """Median, mean and p99 of the lognormal before rounding and clamping (for reports)."""
    m, s = config.turns_median, config.turns_sigma
    return {"median": m, "mean": m * math.exp(s * s / 2), "p99": m * math.exp(Z_P99 * s)}


class LongTailEnv(Environment):
    """One episode lasting `num_turns` assistant turns."""

    def __init__(self, config: LongTailConfig, num_turns: int, observation_seed: int) -> None:
        self.config = config
        self.num_turns = num_turns
        self.turns = 0
        self.action_chars = 0
        self.digit_chars = 0
        self._rng = random.Random(observation_seed)

    async def reset(self, sample: PromptSample) -> list[dict[str, str]]:
        return [dict(m) for m in sample.messages]

    async def step(self, action_text: str) -> StepResult:
        self.turns += 1
        self.action_chars += len(action_text)
        self.digit_chars += sum(ch.isdigit() for ch in action_text)
        if self.turns >= self.num_turns:
            reward = self.digit_chars / self.action_chars if self.action_chars else 0.0
            return StepResult(observation="", reward=reward, done=True,
                              info={"num_turns": self.num_turns, "action_chars": self.action_chars})
        observation = "".join(self._rng.choice("0123456789") for _ in range(self.config.observation_chars))
        return StepResult(observation=observation)


def make_longtail(**kwargs: Any) -> Any:
    """Registry builder: `LongTailConfig` fields as keyword arguments. The factory draws each
    new episode's length from one seeded generator, so the n-th trajectory started gets the n-th
    length of the sequence whatever the run does (modes of a benchmark see the same lengths)."""
    config = LongTailConfig(**kwargs)
    rng = random.Random(config.seed)

    def factory(sample: PromptSample) -> LongTailEnv:
        return LongTailEnv(config, draw_turns(config, rng), observation_seed=rng.getrandbits(32))

    return factory
