"""The environment interface the agent loop drives.

An environment is one episode of an agentic task: it turns a dataset sample into the opening chat
messages, then answers each model action (the decoded text of one assistant turn) with an
observation, an optional per-turn reward and a done flag. Environments know nothing of tokens,
engines or log-probs: the agent loop owns tokenisation (token-in / token-out) and the trajectory
record. Implementations live beside this file (`envs/`); external scaffolds adapt to it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


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
    role: str = "tool"
    info: dict[str, Any] = field(default_factory=dict)


class Environment(abc.ABC):
    """One stateful episode. A fresh instance is made for every trajectory."""

    @abc.abstractmethod
    def reset(self, sample: PromptSample) -> list[dict[str, str]]:
        """Start the episode; return the chat messages that form the prompt."""

    @abc.abstractmethod
    async def step(self, action_text: str) -> StepResult:
        """Answer one assistant turn. Must not raise for bad model output: return an error
        observation instead. Exceptions are treated as environment failures by the agent loop."""

    async def close(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Release per-episode resources (sandboxes, containers). Called once, always."""
