"""Session recording on a scripted engine (no model): Qwen3 tool-call markup, history rewrites as
new segments, limits, refused request fields, completions, engine-side aborts."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from megatron_sao.rollout.chat_format import ChatFormat
from tests.rollout.engine_helpers import IM_END, Answer, ScriptedEngine, tools_tokenizer
from tests.rollout.gateway.helpers import BASH_TOOL, action_spans, gateway_on

CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


def _tokens(text: str) -> list[int]:
    return [*tools_tokenizer().encode(text, add_special_tokens=False), IM_END]


def _run(coro):
    return asyncio.run(coro)


def test_qwen3_tool_call_then_rewritten_history_opens_a_new_segment() -> None:
    a1, a2, a3, a4 = _tokens("Let me look.\n" + CALL), _tokens("Done."), _tokens("OK."), _tokens("Again.")
    engine = ScriptedEngine([Answer(a1, "stop", None), Answer(a2, "stop", 2), Answer(a3, "stop", None),
                             Answer(a4, "stop", None)])
    system_user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find the Python file."}]
    rewritten = [*system_user, {"role": "user", "content": "Summary so far: a.py exists. Continue."}]

    async def scaffold():
        async with gateway_on([engine]) as gateway:
            session = gateway.open_session("p")
            agent = openai.AsyncOpenAI(base_url=gateway.session_url(session), api_key="k", max_retries=0)
            first = await agent.chat.completions.create(model="m", messages=system_user, tools=[BASH_TOOL])
            reply = first.choices[0].message
            result = {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "a.py"}
            messages = [*system_user, reply, result]
            second = await agent.chat.completions.create(model="m", messages=messages, tools=[BASH_TOOL])
            await agent.chat.completions.create(model="m", messages=rewritten, tools=[BASH_TOOL])
            await agent.chat.completions.create(model="m", messages=rewritten, tools=[BASH_TOOL])
            await agent.close()
            return session, first, second

    session, first, second = _run(scaffold())
    reply = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and reply.content == "Let me look."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in reply.tool_calls]
    assert calls == [("bash", {"command": "ls"})]
    assert second.choices[0].message.content == "Done." and second.choices[0].finish_reason == "stop"

    chat = ChatFormat(tools_tokenizer())
    seg0, seg1, seg2 = session.segments
    obs = chat.encode_observation("a.py", "tool", a1, [BASH_TOOL])
    assert seg0.token_ids == chat.encode_prompt(system_user, [BASH_TOOL]) + a1 + obs + a2
    assert action_spans(seg0) == [a1, a2]
    assert seg0.policy_versions[seg0.turns[1].action_start:] == [0, 0, 1, 1, 1, 1]  # the update landed at token 2
    # The rewritten history is rendered as a fresh prompt, not spliced into segment 0.
    assert seg1.token_ids == chat.encode_prompt(rewritten, [BASH_TOOL]) + a3
    assert seg1.metadata["segment_reason"].startswith("history_rewritten: message 2 (user)")
    assert seg2.metadata["segment_reason"] == "regenerated" and action_spans(seg2) == [a4]
    assert [s.metadata["segment"] for s in session.segments] == [0, 1, 2]
    assert {s.metadata["episode_id"] for s in session.segments} == {session.session_id}
    for seg, calls in ((seg0, engine.calls[:2]), (seg1, engine.calls[2:3])):
        logprobs = [lp for call in calls for lp in call[3]]
        assert [seg.rollout_logprobs[i] for i, m in enumerate(seg.loss_mask) if m] == logprobs


def test_limits_answer_400_and_are_remembered() -> None:
    engine = ScriptedEngine([Answer(_tokens("one"), "stop", None), Answer(_tokens("two"), "stop", None)])
    messages = [{"role": "user", "content": "hi"}]

    async def scaffold():
        async with gateway_on([engine], max_turns=1) as gateway:
            session = gateway.open_session("p")
            agent = openai.AsyncOpenAI(base_url=gateway.session_url(session), api_key="k", max_retries=0)
            reply = (await agent.chat.completions.create(model="m", messages=messages)).choices[0].message
            with pytest.raises(openai.BadRequestError, match="limit of 1 model turns"):
                await agent.chat.completions.create(model="m", messages=[*messages, reply,
                                                                         {"role": "user", "content": "more"}])
            await agent.close()
            return session

    session = _run(scaffold())
    assert session.limit_reason == "max_turns" and len(session.segments[0].turns) == 1

    async def too_long():
        async with gateway_on([ScriptedEngine([])], max_total_tokens=20) as gateway:
            session = gateway.open_session("p")
            agent = openai.AsyncOpenAI(base_url=gateway.session_url(session), api_key="k", max_retries=0)
            with pytest.raises(openai.BadRequestError) as info:
                await agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 50}])
            assert info.value.code == "context_length_exceeded"
            await agent.close()
            return session

    session = _run(too_long())
    assert session.limit_reason == "max_total_tokens" and session.segments == []


def test_refused_fields_and_unknown_sessions() -> None:
    async def scaffold():
        async with gateway_on([ScriptedEngine([])]) as gateway:
            session = gateway.open_session("p")
            agent = openai.AsyncOpenAI(base_url=gateway.session_url(session), api_key="k", max_retries=0)
            messages = [{"role": "user", "content": "hi"}]
            for extra, field in (({"n": 2}, "n"), ({"presence_penalty": 0.5}, "presence_penalty"),
                                 ({"response_format": {"type": "json_object"}}, "response_format"),
                                 ({"logit_bias": {"5": 3}}, "logit_bias")):
                with pytest.raises(openai.BadRequestError) as info:
                    await agent.chat.completions.create(model="m", messages=messages, **extra)
                assert info.value.param == field
            gateway.close_session(session)
            with pytest.raises(openai.NotFoundError):
                await agent.chat.completions.create(model="m", messages=messages)
            root = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
            with pytest.raises(openai.NotFoundError, match="session URL"):
                await root.chat.completions.create(model="m", messages=messages)
            await agent.close()
            await root.close()

    _run(scaffold())


def test_completions_continue_a_segment_only_when_the_prompt_extends_it() -> None:
    tok = tools_tokenizer()
    a1, a2, a3, a4 = _tokens("abc"), _tokens("def"), _tokens("xyz"), _tokens("uvw")
    engine = ScriptedEngine([Answer(a1, "stop", None), Answer(a2, "stop", None), Answer(a3, "stop", None),
                             Answer(a4, "stop", None)])

    async def scaffold():
        async with gateway_on([engine]) as gateway:
            session = gateway.open_session("p")
            agent = openai.AsyncOpenAI(base_url=gateway.session_url(session), api_key="k", max_retries=0)
            first = await agent.completions.create(model="m", prompt="Q: 1+1?\nA:")
            text = "Q: 1+1?\nA:" + first.choices[0].text + "\nQ: 2+2?\nA:"
            await agent.completions.create(model="m", prompt=text)
            await agent.completions.create(model="m", prompt="unrelated")
            stream = await agent.completions.create(model="m", prompt="unrelatedxyz<|im_end|>more", stream=True)
            streamed = "".join([chunk.choices[0].text async for chunk in stream])
            assert streamed == "uvw<|im_end|>"
            await agent.close()
            return session, first

    session, first = _run(scaffold())
    assert first.choices[0].text == "abc<|im_end|>"
    seg0, seg1 = session.segments
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert seg0.token_ids == enc("Q: 1+1?\nA:") + a1 + enc("\nQ: 2+2?\nA:") + a2
    # "unrelated" + its answer + "more" extends segment 1: only "more" is new, after the engine's tokens.
    assert seg1.token_ids == enc("unrelated") + a3 + enc("more") + a4
    assert seg1.metadata["segment_reason"] == "new_prompt"


def test_engine_side_abort_resumes_the_same_turn() -> None:
    partial, rest = _tokens("hello wor")[:-1], _tokens("ld")
    engine = ScriptedEngine([Answer(partial, "abort", None), Answer(rest, "stop", None)])

    async def scaffold():
        async with gateway_on([engine]) as gateway:
            session = gateway.open_session("p")
            agent = openai.AsyncOpenAI(base_url=gateway.session_url(session), api_key="k", max_retries=0)
            reply = await agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            await agent.close()
            return session, reply

    session, reply = _run(scaffold())
    (seg,) = session.segments
    assert reply.choices[0].message.content == "hello world"
    assert action_spans(seg) == [partial + rest] and seg.num_engine_retries == 1
    assert engine.calls[1][0] == seg.token_ids[: seg.turns[0].action_start] + partial
