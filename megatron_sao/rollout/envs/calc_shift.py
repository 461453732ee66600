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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_sao.rollout.environment import STREAM_POSITION_KEY, PromptSample, StepResult
from megatron_sao.rollout.envs.calc import CalcConfig, CalcEnv, char_f1

PREFERENCES = ("result", "echo")


@dataclass(kw_only=True, slots=True)
class CalcShiftConfig:
    phases: tuple[str, ...] = ("result", "echo", "result")
    phase_length: int = 640
    """Prompts drawn from the stream per phase (e.g. 40 steps of batch 16)."""
    calc: CalcConfig = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.phases = tuple(self.phases)
        unknown = [p for p in self.phases if p not in PREFERENCES]
        if not self.phases or unknown:
            raise ValueError(f"calc_shift phases must be a non-empty list of {list(PREFERENCES)}, got "
                             f"{list(self.phases)}")
        if self.phase_length < 1:
            raise ValueError(f"calc_shift phase_length must be >= 1, got {self.phase_length}")
        if self.calc is None:
            self.calc = CalcConfig()

    def phase_at(self, position: int) -> int:
        return min(position // self.phase_length, len(self.phases) - 1)


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


def make_calc_shift(phases: list[str] | tuple[str, ...] = ("result", "echo", "result"), phase_length: int = 640,
                    **calc_kwargs: Any) -> Any:
    """Registry builder: the phases, their length in stream positions, and CalcConfig fields."""
    config = CalcShiftConfig(phases=tuple(phases), phase_length=phase_length, calc=CalcConfig(**calc_kwargs))
    return lambda sample: CalcShiftEnv(config)
