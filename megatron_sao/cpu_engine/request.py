"""One generation request inside the CPU engine, from admission to its SGLang-shaped answer."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_sao.cpu_engine.logprobs import LogprobState
from megatron_sao.cpu_engine.routing_capture import RoutingRecord
from megatron_sao.cpu_engine.sampling_params import SamplingConfig


@dataclass(eq=False, slots=True)
class EngineRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingConfig
    max_new_tokens: int  # sampling.max_new_tokens capped by the context length
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    logprobs: LogprobState | None = None  # set with return_logprob: prompt / top-k / token-id entries
    return_prompt_token_ids: bool = False
    routed_experts_start_len: int | None = None  # set with return_routed_experts: first position returned
    routing: RoutingRecord | None = None  # per-position routing, when the engine captures it and it was asked
    generator: torch.Generator | None = None  # set when the request carries a sampling_seed
    stop_window: int = 0  # tokens to decode when looking for a stop string
    failures: int = 0  # failed decode steps this request was in (scheduler._retract_after_failure)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    version_spans: list[list[Any]] = field(default_factory=list)  # [version, start, end)
    finish_reason: dict[str, Any] | None = None
    created_at: float = field(default_factory=time.monotonic)
    finished_at: float = 0.0
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    progress: int = 0  # output tokens fully recorded (a streaming reader's bound; set last in append)
    listener: Callable[[], None] | None = None  # called (scheduler thread) after each token and at the end

    def _notify(self) -> None:
        if self.listener is not None:
            self.listener()

    def append(self, token: int, logprob: float, version: str) -> None:
        n = len(self.output_ids)
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        if self.version_spans and self.version_spans[-1][0] == version:
            self.version_spans[-1][2] = n + 1
        else:
            self.version_spans.append([version, n, n + 1])
        self.progress = n + 1
        self._notify()

    def weight_version_spans(self, current_version: str) -> list[dict[str, Any]]:
        """SGLang's `meta_info["weight_versions"]`: which weight version produced which output
        tokens, as `[start, end)` spans (a request with no output gets one empty span)."""
        if not self.version_spans:
            return [{"version": current_version, "start": 0, "end": 0}]
        return [{"version": v, "start": s, "end": e} for v, s, e in self.version_spans]

    def finish(self, reason: dict[str, Any]) -> None:
        self.finish_reason = reason
        self.finished_at = time.monotonic()
        if not self.future.done():
            self.future.set_result(self)
        self._notify()

    def fail(self, error: BaseException) -> None:
        self.finished_at = time.monotonic()
        if not self.future.done():
            self.future.set_exception(error)
        self._notify()


def abort_reason(message: str, status_code: int | None = None) -> dict[str, Any]:
    """SGLang's `FINISH_ABORT.to_json()`."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}
