"""Templates that render `tool_calls` themselves and group consecutive tool results (as Qwen3's
does): parallel tool calls are appended token-exactly, and a rewritten history with structured
tool calls is rendered by the template."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import openai

from megatron_sao.rollout.chat_format import ChatFormat
from megatron_sao.rollout.gateway.messages import template_renders_tool_calls
from megatron_sao.rollout.gateway.tool_parsers import tool_format_for
from tests.rollout.engine_helpers import IM_END, Answer, ScriptedEngine, tools_tokenizer
from tests.rollout.gateway.helpers import BASH_TOOL, gateway_on

# Qwen3-like: tool results in one `user` block of <tool_response>s; assistant tool_calls rendered
# as <tool_call> JSON lines after the content.
QWEN3_LIKE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{ t | tojson }}{{ '\\n' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + m.content }}"
    "{%- for tc in m.tool_calls or [] %}{%- if not loop.first or m.content %}{{ '\\n' }}{%- endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}"
    "{{- tc.function.arguments | tojson }}{{ '}\\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALLS_TEXT = ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call>')


def _tokenizer():
    tok = tools_tokenizer()
    tok.chat_template = QWEN3_LIKE
    return tok


def test_parallel_tool_results_are_rendered_together_and_rewrites_use_native_tool_calls() -> None:
    tok = _tokenizer()
    assert template_renders_tool_calls(tok)
    a1 = [*tok.encode(CALLS_TEXT, add_special_tokens=False), IM_END]
    a2 = [*tok.encode("Two files.", add_special_tokens=False), IM_END]
    a3 = [*tok.encode("Fine.", add_special_tokens=False), IM_END]
    engine = ScriptedEngine([Answer(a1, "stop", None), Answer(a2, "stop", None), Answer(a3, "stop", None)])
    task = [{"role": "user", "content": "Where am I and what is here?"}]

    async def scaffold():
        async with gateway_on([engine], tokenizer=tok) as gateway:
            session = gateway.open_session("p")
            agent = openai.AsyncOpenAI(base_url=gateway.session_url(session), api_key="k", max_retries=0)
            reply = (await agent.chat.completions.create(model="m", messages=task, tools=[BASH_TOOL])).choices[0]
            calls = reply.message.tool_calls
            messages = [*task, reply.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": calls[0].id, "content": "a.py"},
                        {"role": "tool", "tool_call_id": calls[1].id, "content": "/work"}]
            second = (await agent.chat.completions.create(model="m", messages=messages, tools=[BASH_TOOL])).choices[0]
            rewritten = [{"role": "user", "content": "(earlier task, summarised)"}, *messages[1:]]
            await agent.chat.completions.create(model="m", messages=rewritten, tools=[BASH_TOOL])
            await agent.close()
            return session, reply, messages, second, rewritten

    session, reply, messages, second, rewritten = asyncio.run(scaffold())
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    assert [c.function.arguments for c in reply.message.tool_calls] == ['{"command": "ls"}', '{"command": "pwd"}']
    seg0, seg1 = session.segments

    # Segment 0 is exactly what the template renders for the conversation as the scaffold sees it.
    structured = [*task, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "bash", "arguments": {"command": c}}} for c in ("ls", "pwd")]},
        *messages[2:], {"role": "assistant", "content": second.message.content}]
    rendered = tok.apply_chat_template(structured, tokenize=False, tools=[BASH_TOOL])
    assert tok.decode(seg0.token_ids, skip_special_tokens=False) == rendered.removesuffix("\n")
    assert [seg0.token_ids[t.action_start:t.action_end] for t in seg0.turns] == [a1, a2]
    # Both tool results form one masked observation between the two actions.
    assert seg0.turns[0].observation_end - seg0.turns[0].action_end > 0 and len(seg0.turns) == 2

    # The rewritten history (structured tool calls inside) is rendered by the template itself.
    chat = ChatFormat(tok)
    prompt_messages = [rewritten[0], structured[1], *rewritten[2:]]
    assert seg1.token_ids == chat.encode_prompt(prompt_messages, [BASH_TOOL]) + a3
    assert seg1.metadata["segment_reason"].startswith("history_rewritten: message 0")


def test_the_tool_call_format_follows_the_template() -> None:
    assert tool_format_for(SimpleNamespace(chat_template="...<arg_key>{{ k }}</arg_key>...")) == "glm"
    assert tool_format_for(SimpleNamespace(chat_template=QWEN3_LIKE)) == "qwen3"
    assert not template_renders_tool_calls(tools_tokenizer())  # the plain test template drops them
