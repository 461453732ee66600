"""Tool-call parsing and the notebook-style last-expression rewrite."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from megatron_sao.rollout.envs.tool_calls import parse_tool_calls, print_last_expression, strip_reasoning

FENCE = "`" * 3


def _qwen(code: str, name: str = "python") -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"code": code}}) + "</tool_call>"


def test_qwen_calls() -> None:
    parsed = parse_tool_calls("Let me compute.\n" + _qwen("print(1)") + "\n" + _qwen("print(2)"))
    assert [(c.name, c.arguments) for c in parsed.calls] == [("python", {"code": "print(1)"}),
                                                              ("python", {"code": "print(2)"})]
    assert parsed.errors == [] and parsed.has_tool_intent
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"x\\"}"}</tool_call>'
    assert parse_tool_calls(as_string).calls[0].arguments == {"code": "x"}


@pytest.mark.parametrize(("text", "error"), [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'must be a JSON object with a "name"'),
    ('<tool_call>{"name": "python", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "python", "arguments": "{oops"}</tool_call>', "are not valid JSON"),
    ('<tool_call>{"name": "python", "arguments": {"code": "1"}}', "unterminated <tool_call>"),
])
def test_malformed_calls_are_errors_not_exceptions(text: str, error: str) -> None:
    parsed = parse_tool_calls(text)
    assert parsed.calls == [] and len(parsed.errors) == 1 and error in parsed.errors[0]
    assert parsed.has_tool_intent  # the turn is a (failed) call, not a final answer


def test_fenced_blocks_and_syntax_choice() -> None:
    text = f"Compute:\n{FENCE}python\nprint(6*7)\n{FENCE}\nand {_qwen('print(0)')}"
    assert [c.arguments["code"] for c in parse_tool_calls(text, "fenced").calls] == ["print(6*7)\n"]
    assert [c.arguments["code"] for c in parse_tool_calls(text, "qwen").calls] == ["print(0)"]
    assert len(parse_tool_calls(text, "both").calls) == 2
    assert not parse_tool_calls(f"{FENCE}text\nnot code\n{FENCE}", "fenced").has_tool_intent
    with pytest.raises(ValueError, match="unknown tool-call syntax"):
        parse_tool_calls("x", "xml")


def test_reasoning_is_not_parsed() -> None:
    draft = f"<think>maybe {_qwen('print(1)')} or\n{FENCE}python\nprint(2)\n{FENCE}</think>"
    parsed = parse_tool_calls(draft + r"The answer is \boxed{3}.", "both")
    assert not parsed.has_tool_intent and parsed.visible_text == r"The answer is \boxed{3}."
    # Qwen3 thinking templates open <think> in the prompt: only the closing tag is generated.
    assert strip_reasoning("draft " + _qwen("x") + "</think>final") == "final"
    assert strip_reasoning("<think>unfinished " + _qwen("x")) == ""


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<cell>", "exec"), {})  # the test's own code, not model output
    return out.getvalue()


@pytest.mark.parametrize(("code", "printed"), [
    ("x = 2\nx ** 10", "1024\n"),
    ("x = 'a'\nx * 2  # comment", "'aa'\n"),
    ("values = [3, 1, 2]\nsorted(\n    values)", "[1, 2, 3]\n"),
    ("a = 1; a + 1", "2\n"),
    ("print(5)", "5\n"),
    ("None", ""),
    ("x = 1", ""),
    ("for i in range(2):\n    i", ""),
])
def test_print_last_expression(code: str, printed: str) -> None:
    assert _run(print_last_expression(code)) == printed


def test_print_last_expression_keeps_line_numbers_and_bad_code() -> None:
    code = "a = 1\nb = 0\na / b"
    rewritten = print_last_expression(code)
    assert rewritten.splitlines()[2].startswith("__sao_value = (a / b)")  # still line 3
    assert print_last_expression("def f(:\n  1") == "def f(:\n  1"
