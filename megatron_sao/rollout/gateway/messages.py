"""OpenAI chat messages: validation, the comparison keys of the history check, and the form the
chat template renders.

A scaffold sends its whole conversation with every request. The gateway recorded the earlier
turns token by token; to know whether the new request *appends* to that record it compares
messages by `message_key`: role, text content (parts joined, whitespace at the ends ignored) and,
for assistant messages, the tool calls by name and parsed arguments (ids ignored: scaffolds
re-number them). Everything else a client may echo back (`refusal`, `annotations`, `name`, ids)
does not take part.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from megatron_sao.rollout.gateway.tool_parsers import ParsedCall, ToolCallFormat

Message = dict[str, Any]
MessageKey = tuple[str, str, str]

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """The request is malformed; answered with HTTP 400 and OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of `{"type": "text", "text"}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                raise RequestError(f"{where}.content: only text parts are supported, got {str(part)[:80]}", where)
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise RequestError(f"{where}.content must be a string, null or a list of text parts", where)


def message_calls(message: Message, where: str) -> list[ParsedCall]:
    calls = []
    for i, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{i}] needs function.name", f"{where}.tool_calls")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                arguments = {"__unparsed__": arguments}
        if not isinstance(arguments, dict):
            arguments = {"__value__": arguments}
        calls.append(ParsedCall(function["name"], arguments))
    return calls


def validate_messages(messages: Any) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] needs a role in {ROLES}", f"messages[{i}].role")
        content_text(m.get("content"), f"messages[{i}]")
        message_calls(m, f"messages[{i}]")
    return messages


def calls_key(calls: list[ParsedCall]) -> str:
    return json.dumps([[c.name, c.arguments] for c in calls], sort_keys=True, ensure_ascii=False)


def message_key(message: Message) -> MessageKey:
    role = "system" if message["role"] == "developer" else message["role"]
    calls = message_calls(message, "message") if role == "assistant" else []
    return role, content_text(message.get("content"), "message").strip(), calls_key(calls)


def assistant_key(content: str, calls: list[ParsedCall]) -> MessageKey:
    return "assistant", content.strip(), calls_key(calls)


def template_message(message: Message, tool_format: ToolCallFormat, native_tool_calls: bool) -> dict[str, Any]:
    """The message as the chat template takes it. Assistant tool calls go in `tool_calls` (arguments
    as objects) when the template renders them, else into the content in the family's markup."""
    role = "system" if message["role"] == "developer" else message["role"]
    text = content_text(message.get("content"), "message")
    calls = message_calls(message, "message") if role == "assistant" else []
    if not calls:
        return {"role": role, "content": text}
    if native_tool_calls:
        return {"role": role, "content": text, "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
    return {"role": role, "content": tool_format.render(text, calls)}


_PROBE_NAME = "SAOSENTINELTOOLNAMEQ7"


@functools.lru_cache(maxsize=32)
def _renders_tool_calls(template: str | None, tokenizer_id: int, tokenizer: Any) -> bool:
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}]}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that chokes on tool_calls does not render them
        return False
    return _PROBE_NAME in text


def template_renders_tool_calls(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders an assistant message's `tool_calls` itself
    (Qwen3's and GLM's do; a plain template drops them)."""
    return _renders_tool_calls(getattr(tokenizer, "chat_template", None), id(tokenizer), tokenizer)
