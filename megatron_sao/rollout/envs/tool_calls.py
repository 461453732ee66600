"""Tool-call syntax: finding the calls in an assistant turn, and preparing Python code.

Two syntaxes are recognised (an environment chooses which):

- `qwen` (default): `<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`,
  the markup Qwen models are trained to emit when tools are declared in their chat template;
  `arguments` may also be a JSON-encoded string (some servers emit that).
- `fenced`: a Markdown block `` ```python ... ``` `` (ToRA-style TIR data); it is always a call
  of the `python` tool.

Reasoning inside `<think>...</think>` is ignored: code a thinking model drafts there is not a
call. A malformed call (bad JSON, unterminated tag, no `name`) is reported as an error the model
gets to see, never raised.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

SYNTAXES = ("qwen", "fenced", "both")
_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCED = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)
_MAX_CODE_CHARS_FOR_AST = 200_000


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(slots=True)
class ParsedTurn:
    """The calls found in one assistant turn, and problems to report back to the model.

    `visible_text` is the turn with any reasoning removed: the final answer is looked for there.
    """

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    visible_text: str = ""

    @property
    def has_tool_intent(self) -> bool:
        """The model tried to call a tool (even if malformed): the episode goes on."""
        return bool(self.calls or self.errors)


def strip_reasoning(text: str) -> str:
    """Drop `<think>` blocks; with only a closing `</think>` (the opening tag was part of the
    generation prompt), everything before it."""
    if "</think>" in text:
        text = text[text.rindex("</think>") + len("</think>"):]
    return re.sub(r"<think>.*?(</think>|$)", "", text, flags=re.DOTALL)


def parse_tool_calls(text: str, syntax: str = "qwen") -> ParsedTurn:
    if syntax not in SYNTAXES:
        raise ValueError(f"unknown tool-call syntax {syntax!r}; use one of {SYNTAXES}")
    visible = strip_reasoning(text)
    parsed = ParsedTurn(visible_text=visible)
    if syntax in ("qwen", "both"):
        for body in _QWEN_CALL.findall(visible):
            _parse_qwen_body(body, parsed)
        tail = _QWEN_CALL.sub("", visible)
        if "<tool_call>" in tail:
            parsed.errors.append("unterminated <tool_call>: close it with </tool_call>")
    if syntax in ("fenced", "both"):
        for code in _FENCED.findall(visible):
            parsed.calls.append(ToolCall("python", {"code": code}))
    return parsed


def _parse_qwen_body(body: str, parsed: ParsedTurn) -> None:
    try:
        call = json.loads(body)
    except ValueError as e:
        parsed.errors.append(f"tool call is not valid JSON ({e})")
        return
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        parsed.errors.append('tool call must be a JSON object with a "name" and "arguments"')
        return
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            parsed.errors.append(f"arguments of tool {call['name']!r} are not valid JSON")
            return
    if not isinstance(arguments, dict):
        parsed.errors.append(f"arguments of tool {call['name']!r} must be a JSON object")
        return
    parsed.calls.append(ToolCall(call["name"], arguments))


def print_last_expression(code: str) -> str:
    """Make a trailing bare expression print its repr, as a REPL or notebook cell would.

    TIR models often end a cell with `x` expecting to see it. Line numbers of the code are kept
    (tracebacks point at the model's own lines). Code that does not parse is left alone (the
    sandbox reports the SyntaxError); a `print(...)` call or a None value prints nothing extra.
    """
    if len(code) > _MAX_CODE_CHARS_FOR_AST:
        return code
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    value = tree.body[-1].value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "print":
        return code
    segment = ast.get_source_segment(code, value)
    if segment is None or value.end_lineno is None or value.end_col_offset is None:
        return code
    lines = code.splitlines(keepends=True)
    first, last = lines[value.lineno - 1], lines[value.end_lineno - 1]
    before = "".join(lines[:value.lineno - 1]) + first[:value.col_offset]
    after_on_line = last[value.end_col_offset:].rstrip("\r\n")
    rewritten = (f"{before}__sao_value = ({segment}){after_on_line}\n"
                 "if __sao_value is not None:\n    print(repr(__sao_value))\n" + "".join(lines[value.end_lineno:]))
    try:
        ast.parse(rewritten)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code
    return rewritten
