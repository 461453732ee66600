"""The gateway's small value types: session limits, one turn's request and result, HTTP errors."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sao.rollout.gateway.tool_parsers import ParsedCall


class GatewayError(RuntimeError):
    """Answered with `status` and OpenAI's error shape."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(kw_only=True, slots=True)
class SessionLimits:
    max_total_tokens: int = 8192
    """Tokens of one segment; a request that would not leave room to sample -> 400
    `context_length_exceeded` and the episode is TRUNCATED ("max_total_tokens")."""
    max_turns: int = 64
    """Model turns per episode (all segments); one more request -> 400 and TRUNCATED ("max_turns")."""
    max_new_tokens_per_turn: int = 2048
    """Cap (and default) of a request's `max_tokens`."""
    temperature: float | None = None
    """Overrides the request's temperature when set (RL usually samples at the policy's 1.0)."""
    top_p: float | None = None
    """Overrides the request's top_p when set."""
    max_engine_retries: int = 16


@dataclass(kw_only=True, slots=True)
class TurnRequest:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass(slots=True)
class Generation:
    text: str
    """The turn's text (stop token removed, cut before a matched stop string)."""
    content: str
    calls: list[ParsedCall]
    finish_reason: str  # OpenAI's: stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int
    segment: int
    stop_string: str | None = None
    """The request's stop string the turn ended on, if any."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
