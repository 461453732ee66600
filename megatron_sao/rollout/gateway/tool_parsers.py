"""Tool calls both ways between a model family's text markup and OpenAI's `tool_calls`.

The gateway hands a scaffold OpenAI-style `tool_calls` parsed out of the model's sampled text
(`parse`), and, when it has to render a history it did not record itself (a rewritten history
opens a new segment), turns the scaffold's assistant `tool_calls` back into the family's markup
(`render`) for chat templates that do not render `tool_calls` on their own.

- `qwen3` (Qwen2.5 / Qwen3 / Hermes style, SGLang's `qwen25` detector):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call.
- `glm` (GLM-4.5 / GLM-4.6 / GLM-5, SGLang's `glm45` detector):
  `<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>`; string values
  raw, other values JSON.

Reasoning in `<think>...</think>` is never parsed for calls. A malformed block stays in the
content as text (the scaffold sees what the model wrote) and is not a call.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]


class ToolCallFormat(Protocol):
    name: str

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content without the call blocks, the calls) of one assistant turn's text."""

    def render(self, content: str, calls: list[ParsedCall]) -> str:
        """The assistant turn's text as the family writes it: `content` then the calls."""


_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning prefix kept verbatim, the visible rest): calls are only looked for in the rest."""
    if "</think>" in text:
        cut = text.rindex("</think>") + len("</think>")
        return text[:cut], text[cut:]
    return "", text


def _parse_blocks(text: str, parse_body) -> tuple[str, list[ParsedCall]]:
    reasoning, visible = _split_reasoning(text)
    calls: list[ParsedCall] = []
    kept: list[str] = []
    cursor = 0
    for match in _BLOCK.finditer(visible):
        call = parse_body(match.group(1))
        kept.append(visible[cursor : match.start()])
        if call is None:  # malformed: left in the content for the scaffold to see
            kept.append(match.group(0))
        else:
            calls.append(call)
        cursor = match.end()
    kept.append(visible[cursor:])
    content = reasoning + "".join(kept)
    return (content.strip() if calls else content), calls


class Qwen3ToolFormat:
    name = "qwen3"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        return _parse_blocks(text, self._parse_body)

    @staticmethod
    def _parse_body(body: str) -> ParsedCall | None:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        return ParsedCall(data["name"], arguments) if isinstance(arguments, dict) else None

    def render(self, content: str, calls: list[ParsedCall]) -> str:
        blocks = [
            '<tool_call>\n{"name": ' + json.dumps(c.name, ensure_ascii=False) + ', "arguments": '
            + json.dumps(c.arguments, ensure_ascii=False) + "}\n</tool_call>"
            for c in calls
        ]
        return "\n".join(([content] if content else []) + blocks)


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class GlmToolFormat:
    name = "glm"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        return _parse_blocks(text, self._parse_body)

    @staticmethod
    def _parse_body(body: str) -> ParsedCall | None:
        head, _, rest = body.partition("<arg_key>")
        name = head.strip()
        if not name or "\n" in name or "<" in name:
            return None
        rest = "<arg_key>" + rest if rest else ""
        arguments: dict[str, Any] = {}
        for key, raw in _GLM_ARG.findall(rest):
            try:
                arguments[key.strip()] = json.loads(raw)
            except ValueError:
                arguments[key.strip()] = raw
        if _GLM_ARG.sub("", rest).strip():  # text between the pairs: not GLM's markup
            return None
        return ParsedCall(name, arguments)

    def render(self, content: str, calls: list[ParsedCall]) -> str:
        out = content
        for c in calls:
            out += "\n<tool_call>" + c.name + "\n"
            for key, value in c.arguments.items():
                text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                out += f"<arg_key>{key}</arg_key>\n<arg_value>{text}</arg_value>\n"
            out += "</tool_call>"
        return out


_FORMATS: dict[str, type] = {"qwen3": Qwen3ToolFormat, "qwen": Qwen3ToolFormat, "glm": GlmToolFormat}


def get_tool_format(spec: str | ToolCallFormat) -> ToolCallFormat:
    """`qwen3` (alias `qwen`), `glm`, "module:attribute" naming a class with `parse` / `render`, or
    such an object itself."""
    if not isinstance(spec, str):
        return spec
    if spec in _FORMATS:
        return _FORMATS[spec]()
    if ":" not in spec:
        raise ValueError(f"unknown tool_call_format {spec!r}: use one of {sorted(_FORMATS)} or 'module:attribute'")
    module, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"tool_call_format {spec!r} cannot be imported: {e}") from e
    instance = obj() if isinstance(obj, type) else obj
    if not (callable(getattr(instance, "parse", None)) and callable(getattr(instance, "render", None))):
        raise ValueError(f"tool_call_format {spec!r} has no parse / render methods")
    return instance


def tool_format_for(tokenizer: Any) -> str:
    """The format the tokenizer's chat template writes tool calls in: `glm` when it renders GLM's
    `<arg_key>` markup, else `qwen3`."""
    return "glm" if "<arg_key>" in str(getattr(tokenizer, "chat_template", "") or "") else "qwen3"
