"""OpenAI's chat-completions / completions request and response shapes (what the gateway honours).

Honoured: `messages`, `tools` (declared to the chat template), `tool_choice` ("none" turns
tool-call parsing off; other values are accepted but not enforced: the policy decides), `stop`,
`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stream` (+
`stream_options.include_usage`), `logprobs` (the sampled tokens' log-probs, no alternatives).
Refused with a 400 naming the field, because honouring them would change what the policy samples
or what is recorded: `n` > 1, `best_of` > 1, penalties, `logit_bias`, `top_logprobs` > 0, a
`response_format` other than text, `echo`. Other fields (`user`, `metadata`, `parallel_tool_calls`,
`store`, ...) are ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megatron_sao.rollout.gateway.messages import Message, RequestError, validate_messages
from megatron_sao.rollout.gateway.types import Generation, TurnRequest


@dataclass(slots=True)
class ChatRequest:
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    parse_calls: bool
    turn: TurnRequest
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise RequestError(f"{name} > 1 is not supported: one episode is one trajectory", name)
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        if body.get(name) not in (None, 0, 0.0) and not (name == "repetition_penalty" and body[name] == 1):
            raise RequestError(f"{name} is not supported: it would change what the policy samples", name)
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported: it would change what the policy samples", "logit_bias")
    if body.get("top_logprobs"):
        raise RequestError("top_logprobs is not supported (the sampled tokens' logprobs are)", "top_logprobs")
    if body.get("echo"):
        raise RequestError("echo is not supported", "echo")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise RequestError("response_format other than text is not supported (no constrained decoding)",
                           "response_format")


def turn_request(body: dict[str, Any]) -> TurnRequest:
    _refuse_unsupported(body)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"seed must be an integer, got {seed!r}", "seed")
    return TurnRequest(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                       top_p=_number(body, "top_p", 1.0, 0.0, 1.0), stop=list(stop or []), seed=seed)


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = validate_messages(body.get("messages"))
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise RequestError('tools must be a list of {"type": "function", "function": {"name", ...}}', "tools")
    options = body.get("stream_options") or {}
    parse_calls = tools is not None and body.get("tool_choice") != "none"
    return ChatRequest(messages=messages, tools=tools, parse_calls=parse_calls,
                       turn=turn_request(body), stream=bool(body.get("stream")),
                       include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
                       logprobs=bool(body.get("logprobs")), model=str(body.get("model") or ""))


def parse_completion_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [int(t) for t in prompt]
    raise RequestError("prompt must be one non-empty string or one list of token ids (no batches)", "prompt")


# ---- responses ----------------------------------------------------------------------------------


def _usage(gen: Generation) -> dict[str, int]:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def tool_call_dicts(gen: Generation) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for c in gen.calls]


def _logprobs(gen: Generation, token_texts: list[str]) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(token_texts, gen.logprobs, strict=True)]}


def chat_completion(gen: Generation, model: str, token_texts: list[str] | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": gen.content if (gen.content or not gen.calls) else None}
    if gen.calls:
        message["tool_calls"] = tool_call_dicts(gen)
    choice = {"index": 0, "message": message, "finish_reason": gen.finish_reason,
              "logprobs": None if token_texts is None else _logprobs(gen, token_texts)}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(gen)}


def chat_chunks(gen: Generation, model: str, include_usage: bool) -> Iterator[str]:
    """The turn as OpenAI SSE chunks (generated whole, then streamed), ending with `[DONE]`."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                           "logprobs": None}]}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if gen.content:
        yield chunk({"content": gen.content})
    for i, call in enumerate(tool_call_dicts(gen)):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, gen.finish_reason)
    if include_usage:
        yield "data: " + json.dumps({**base, "choices": [], "usage": _usage(gen)}) + "\n\n"
    yield "data: [DONE]\n\n"


def completion(gen: Generation, model: str) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "text": gen.text, "finish_reason": gen.finish_reason,
                                         "logprobs": None}], "usage": _usage(gen)}


def completion_chunks(gen: Generation, model: str) -> Iterator[str]:
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}
    yield "data: " + json.dumps({**base, "choices": [{"index": 0, "text": gen.text, "finish_reason": None,
                                                      "logprobs": None}]}) + "\n\n"
    yield "data: " + json.dumps({**base, "choices": [{"index": 0, "text": "", "finish_reason": gen.finish_reason,
                                                      "logprobs": None}]}) + "\n\n"
    yield "data: [DONE]\n\n"


def error_body(message: str, code: str | None, param: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
