"""Tool-call markup both ways for the shipped families, and the history-check keys."""

from __future__ import annotations

import pytest

from megatron_sao.rollout.gateway.messages import RequestError, assistant_key, message_key, validate_messages
from megatron_sao.rollout.gateway.tool_parsers import GlmToolFormat, ParsedCall, Qwen3ToolFormat, get_tool_format

CALLS = [ParsedCall("bash", {"command": "ls -la", "timeout": 5}), ParsedCall("submit", {})]


def test_qwen3_parses_its_markup_and_keeps_reasoning_out_of_calls() -> None:
    text = ('<think>maybe <tool_call>{"name": "no", "arguments": {}}</tool_call></think>\nLooking.\n'
            '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la", "timeout": 5}}\n</tool_call>\n'
            '<tool_call>\n{"name": "submit", "arguments": "{}"}\n</tool_call>')
    content, calls = Qwen3ToolFormat().parse(text)
    assert calls == CALLS
    assert content.startswith("<think>maybe <tool_call>") and content.endswith("Looking.")


def test_qwen3_leaves_malformed_blocks_in_the_content() -> None:
    text = "Try: <tool_call>{not json}</tool_call>"
    assert Qwen3ToolFormat().parse(text) == (text, [])


@pytest.mark.parametrize("fmt", [Qwen3ToolFormat(), GlmToolFormat()], ids=["qwen3", "glm"])
def test_render_then_parse_round_trips(fmt) -> None:
    text = fmt.render("I will look.", CALLS)
    content, calls = fmt.parse(text)
    assert (content, calls) == ("I will look.", CALLS)


def test_glm_markup() -> None:
    text = ("Checking.\n<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls -la</arg_value>\n"
            "<arg_key>timeout</arg_key>\n<arg_value>5</arg_value>\n</tool_call><tool_call>submit\n</tool_call>")
    assert GlmToolFormat().parse(text) == ("Checking.", CALLS)
    assert GlmToolFormat().render("", CALLS[:1]) == (
        "\n<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls -la</arg_value>\n"
        "<arg_key>timeout</arg_key>\n<arg_value>5</arg_value>\n</tool_call>")
    bad = "<tool_call>bash\nstray text<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    assert GlmToolFormat().parse(bad) == (bad, [])


def test_get_tool_format_by_name_and_path() -> None:
    assert isinstance(get_tool_format("qwen"), Qwen3ToolFormat)
    assert isinstance(get_tool_format("megatron_sao.rollout.gateway.tool_parsers:GlmToolFormat"), GlmToolFormat)
    with pytest.raises(ValueError, match="unknown tool_call_format"):
        get_tool_format("llama")


def test_message_keys_ignore_ids_and_client_extras() -> None:
    echoed = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_x", "type": "function",
         "function": {"name": "bash", "arguments": '{"timeout": 5, "command": "ls -la"}'}}]}
    assert message_key(echoed) == assistant_key("", CALLS[:1])
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b "}]}
    assert message_key(parts) == message_key({"role": "user", "content": "ab"})
    with pytest.raises(RequestError, match="only text parts"):
        validate_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(RequestError, match="role"):
        validate_messages([{"role": "robot", "content": "x"}])
