"""The environment interface the agent loop drives.

An environment is one episode of an agentic task: it turns a dataset sample into the opening chat
messages (and, optionally, the tools to declare to the chat template), then answers each model
action (the decoded text of one assistant turn) with an observation, an optional per-turn reward
and a done flag. Environments know nothing of tokens, engines or log-probs: the agent loop owns
tokenisation (token-in / token-out) and the trajectory record. Implementations live beside this
file (`envs/`); external scaffolds adapt to it.

`reset`, `step` and `close` are coroutines because an environment may do I/O in any of them
(start a container, call a server): the agent loop runs hundreds of episodes on one event loop,
and a blocking call in any one of them would stall all the others.
"""

from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass, field
from typing import Any

TRUNCATION_REASON_KEY = "truncation_reason"
"""`StepResult.info[TRUNCATION_REASON_KEY] = "reason"` names the limit behind `truncated=True`
(e.g. "max_turns"); the agent loop records it in the trajectory's `status_reason`."""
STREAM_POSITION_KEY = "stream_position"
"""`PromptSample.metadata` key: the prompt's draw number in the run's prompt stream (0, 1, ...),
written by the pipeline (`pipeline/prompts.positioned`); environments whose behaviour
changes over a run read it (`calc_shift`)."""


@dataclass(slots=True)
class PromptSample:
    """One row of a prompt dataset, after validation.

    `messages` is the chat prompt (OpenAI-style `{"role", "content"}` dicts); `answer` is the
    reference the reward function checks against, when the task has one.
    """

    prompt_id: str
    messages: list[dict[str, str]]
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StepResult:
    """What the environment returns for one action.

    `observation` is the text shown to the model as the next (tool / user) message; it is empty
    when `done` and nothing more is shown. `reward` is credited to the last token of the action
    that produced it (a per-turn reward); the terminal reward comes with `done=True`.
    `role` is the chat role the observation is rendered with.
    """

    observation: str
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    """The episode ended because of a limit of the environment's own (a turn or tool budget), not
    a natural end; requires `done=True`. The agent loop records the trajectory TRUNCATED (reason
    `info[TRUNCATION_REASON_KEY]` when given) and keeps `reward` as its terminal reward: the
    environment scored the episode when it cut it short, so the loop's `truncation_reward` (for
    limits the loop hits itself) does not replace it."""
    role: str = "tool"
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.truncated and not self.done:
            raise ValueError("StepResult(truncated=True) ends the episode: set done=True as well")


class Environment(abc.ABC):
    """One stateful episode. A fresh instance is made for every trajectory.

    The agent loop calls `await reset(sample)` once, reads `tools`, then `await step(action)` until
    a result is done (or a loop limit is hit), and always `await close()` last, also after a
    failed `reset`.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a synchronous `reset` / `step` / `close` when the class is defined: the loop
        awaits them, and an environment written before `reset` became async would otherwise fail
        every trajectory at run time."""
        super().__init_subclass__(**kwargs)
        for name in ("reset", "step", "close"):
            method = cls.__dict__.get(name)
            if method is not None and not inspect.iscoroutinefunction(method):
                raise TypeError(f"{cls.__qualname__}.{name} must be a coroutine (`async def {name}`)")

    @abc.abstractmethod
    async def reset(self, sample: PromptSample) -> list[dict[str, str]]:
        """Start the episode; return the chat messages that form the prompt. Slow preparation
        (starting a sandbox or container, asking a server for the task) belongs here; bound its
        waits yourself, the loop sets no time limit on `reset`."""

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """OpenAI-style JSON tool schemas (`{"type": "function", "function": {"name",
        "description", "parameters"}}`) the chat template declares in the prompt
        (`apply_chat_template(..., tools=...)`), or None to declare none. Read once, after
        `reset`, so an environment may decide them there."""
        return None

    @abc.abstractmethod
    async def step(self, action_text: str) -> StepResult:
        """Answer one assistant turn. Must not raise for bad model output: return an error
        observation instead. Exceptions are treated as environment failures by the agent loop."""

    async def close(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Release per-episode resources (sandboxes, containers). Called once, always."""
