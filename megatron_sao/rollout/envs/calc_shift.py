"""`calc_shift`: the calculator task under a preference that shifts over time (online mode).

The paper's online experiment shifts a preference through three phases during one run and
compares how fast SAO's critic and a running-mean baseline re-adapt. Here the preference is what
the final answer should be, over the same `calc` prompts:

    result   the calculator's result, as in `calc` (call the tool, copy the observation)
    echo     the expression itself, written out as the answer (a tool call earns nothing)

Both are within a tiny model's reach (both are copying), and they conflict: a policy tuned for
one scores ~0.2-0.5 under the other, so each shift shows as a drop and a recovery. The phase of
an episode is a function of its prompt's position in the run's prompt stream
(`stream_position`, written by the pipeline, restored with the stream on resume), so a resumed run
sees the same schedule: `phases[position // phase_length]`, the last phase holding afterwards.
`info["phase"]` records the phase index of every episode.

The policy must be able to write in each style for RL to follow a shift (the paper's policy can
write in each of its three styles; the reward prefers one per phase): `mixed_oracle` writes SFT
demonstrations in both, `result` style (`calc.oracle_action`: call the tool, answer with its
observation) for a share of the prompts and `echo` style (answer with the expression, no call) for
the rest (`demonstration_echo_share`, 0.5 by default). The SFT policy then samples both, and the
style is decided by the first token of the first turn (`<tool_call>` or not): RL moves that one
choice toward whichever style the current phase rewards.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from megatron_sao.rollout.environment import STREAM_POSITION_KEY, PromptSample, StepResult
from megatron_sao.rollout.envs.calc import CalcConfig, CalcEnv, char_f1, oracle_action

PREFERENCES = ("result", "echo")
SHIFT_KEYS = ("phases", "phase_length", "demonstration_echo_share")
"""`rollout.environment_kwargs` keys of `calc_shift` itself (the rest are CalcConfig fields)."""


@dataclass(kw_only=True, slots=True)
class CalcShiftConfig:
    phases: tuple[str, ...] = ("result", "echo", "result")
    phase_length: int = 640
    """Prompts drawn from the stream per phase (e.g. 40 steps of batch 16)."""
    demonstration_echo_share: float = 0.5
    """Share of the SFT demonstrations (`mixed_oracle`, `sao online`) written in the `echo` style;
    the rest are `result` style. Not used by the environment itself."""
    calc: CalcConfig = field(default_factory=CalcConfig)

    def __post_init__(self) -> None:
        self.phases = tuple(self.phases)
        unknown = [p for p in self.phases if p not in PREFERENCES]
        if not self.phases or unknown:
            raise ValueError(f"calc_shift phases must be a non-empty list of {list(PREFERENCES)}, got "
                             f"{list(self.phases)}")
        if self.phase_length < 1:
            raise ValueError(f"calc_shift phase_length must be >= 1, got {self.phase_length}")
        if not 0.0 <= self.demonstration_echo_share <= 1.0:
            raise ValueError(f"calc_shift demonstration_echo_share must be in [0, 1], got "
                             f"{self.demonstration_echo_share}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> CalcShiftConfig:
        """`SHIFT_KEYS` and CalcConfig fields (a recipe's `rollout.environment_kwargs`)."""
        shift = {k: kwargs.pop(k) for k in SHIFT_KEYS if k in kwargs}
        if "phases" in shift:
            shift["phases"] = tuple(shift["phases"])
        return cls(**shift, calc=CalcConfig(**kwargs))

    def phase_at(self, position: int) -> int:
        return min(position // self.phase_length, len(self.phases) - 1)


def demonstration_style(sample: PromptSample, echo_share: float) -> str:
    """The style `mixed_oracle` writes `sample` in: `echo` for a stable pseudo-random `echo_share`
    of prompt ids (a hash of the id, so the same prompt always gets the same style), else `result`."""
    digest = hashlib.blake2b(sample.prompt_id.encode("utf-8"), digest_size=8).digest()
    bucket = int.from_bytes(digest, "big") / 2**64
    return "echo" if bucket < echo_share else "result"


def echo_action(sample: PromptSample, observations: list[str]) -> str:
    """The scripted `echo` policy: answer with the expression at once (no tool call). Reward 1.0
    under the `echo` preference."""
    return str(sample.metadata.get("expression", sample.messages[-1]["content"]))


def mixed_oracle(echo_share: float = 0.5) -> Any:
    """A demonstration writer (`rollout.demonstrations` teacher) in both styles: `echo_action` for
    the `demonstration_style` `echo` prompts, `calc.oracle_action` (`result`) for the others."""
    if not 0.0 <= echo_share <= 1.0:
        raise ValueError(f"mixed_oracle: echo_share must be in [0, 1], got {echo_share}")

    def teacher(sample: PromptSample, observations: list[str]) -> str:
        if demonstration_style(sample, echo_share) == "echo":
            return echo_action(sample, observations)
        return oracle_action(sample, observations)

    return teacher


def echo_score(answer: str | None, expression: str, config: CalcConfig) -> dict[str, float]:
    """The `echo` preference: the expression written out as the answer. The format part keeps
    `calc`'s length term (digits are no longer the point) and the tool's weight moves to the
    answer, so calling the tool, the old preference, earns nothing; an exact echo scores 1."""
    answer = (answer or "").strip()
    fmt = 1.0 / (1.0 + abs(len(answer) - len(expression)) / max(1, len(expression))) if answer else 0.0
    correct = 1.0 if answer == expression else 0.5 * char_f1(answer, expression) if answer else 0.0
    reward = config.format_weight * fmt + (config.tool_weight + config.answer_weight) * correct
    return {"reward": round(reward, 9), "format": fmt, "tool": 0.0, "answer": correct}


class CalcShiftEnv(CalcEnv):
    """A `calc` episode scored under the preference of its phase."""

    def __init__(self, config: CalcShiftConfig) -> None:
        super().__init__(config.calc)
        self.shift = config
        self.phase = 0

    async def reset(self, sample: PromptSample) -> list[dict[str, str]]:
        position = sample.metadata.get(STREAM_POSITION_KEY)
        if not isinstance(position, int) or position < 0:
            raise ValueError(f"calc_shift sample {sample.prompt_id!r}: metadata[{STREAM_POSITION_KEY!r}] must be the "
                             f"prompt's position in the stream (a non-negative int), got {position!r}; the "
                             "pipeline's prompt stream writes it")
        self.phase = self.shift.phase_at(position)
        return await super().reset(sample)

    def _end(self, answer: str | None, truncated: bool) -> StepResult:
        result = super()._end(answer, truncated)
        if self.shift.phases[self.phase] == "echo":
            parts = echo_score(answer, self.expression, self.config)
            result = StepResult(observation="", reward=parts["reward"], done=True, truncated=truncated,
                                info={**result.info, **parts})
        result.info["phase"] = self.phase
        return result


def make_calc_shift(**kwargs: Any) -> Any:
    """Registry builder: `phases`, `phase_length` (stream positions per phase),
    `demonstration_echo_share` (SFT data only) and CalcConfig fields."""
    config = CalcShiftConfig.from_kwargs(**kwargs)
    return lambda sample: CalcShiftEnv(config)
