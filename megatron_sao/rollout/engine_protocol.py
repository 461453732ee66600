"""SGLang's native generate protocol as data: sampling parameters, the parsed `/generate`
answer, finish reasons, per-token weight-version spans, and the client's errors.

`GenerateOutput.from_response` reads SGLang's non-streaming answer
`{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "weight_version", "weight_versions"?, "output_token_logprobs"?,
"routed_experts"?}}` (sglang 0.5.x; `weight_versions` spans exist in current SGLang and in the CPU
engine; `routed_experts` is kept as sent, base64, and decoded with the model's layout by
`rollout/routing.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


class EngineError(RuntimeError):
    """The engine answered with an error."""

    def __init__(self, url: str, message: str, status_code: int | None = None) -> None:
        super().__init__(f"{url}: {message}" + (f" (HTTP {status_code})" if status_code else ""))
        self.url = url
        self.message = message
        self.status_code = status_code


class EngineUnavailableError(EngineError):
    """The engine is unreachable, dropped the connection, or is not ready (503)."""


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """The subset of SGLang's `sampling_params` the rollout uses (None fields are not sent)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(slots=True)
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string
    length: int | None = None
    message: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> FinishReason:
        if not data:
            return cls("abort", message="no finish_reason in the engine's answer")
        return cls(str(data["type"]), data.get("matched"), data.get("length"), data.get("message"))


@dataclass(slots=True)
class VersionSpan:
    """Output tokens `[start, end)` were sampled with weight version `version`."""

    version: str
    start: int
    end: int


@dataclass(slots=True)
class GenerateOutput:
    rid: str
    text: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    weight_version_spans: list[VersionSpan]
    meta_info: dict[str, Any] = field(repr=False)
    routed_experts: str | None = field(default=None, repr=False)
    """`meta_info.routed_experts` as sent (base64 int32), when the engine returned routing."""

    @classmethod
    def from_response(cls, data: dict[str, Any]) -> GenerateOutput:
        meta = data.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs")
        if pairs is not None:  # the token ids that come with the log-probs are authoritative
            output_ids = [int(p[1]) for p in pairs]
            logprobs: list[float] | None = [float(p[0]) for p in pairs]
        else:
            output_ids = [int(t) for t in data.get("output_ids") or []]
            logprobs = None
        version = str(meta.get("weight_version", "default"))
        spans = [
            VersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in meta.get("weight_versions") or []
        ]
        return cls(
            rid=str(meta.get("id", "")),
            text=str(data.get("text", "")),
            output_ids=output_ids,
            output_logprobs=logprobs,
            finish_reason=FinishReason.from_json(meta.get("finish_reason")),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            weight_version=version,
            weight_version_spans=spans,
            meta_info=meta,
            routed_experts=meta.get("routed_experts"),
        )

    def token_versions(self) -> list[str]:
        """The weight version of every output token. Without spans (older SGLang) every token gets
        the answer's `weight_version`, which is exact only if no update landed mid-request."""
        n = len(self.output_ids)
        if not self.weight_version_spans:
            return [self.weight_version] * n
        versions: list[str | None] = [None] * n
        for span in self.weight_version_spans:
            for t in range(max(0, span.start), min(n, span.end)):
                versions[t] = span.version
        if any(v is None for v in versions):
            raise EngineError("", f"weight_versions spans {self.weight_version_spans} do not cover {n} output tokens")
        return versions  # type: ignore[return-value]
