"""An agent written with the `openai` client, through the gateway, on a real CPU engine: the
recorded trajectory is the engine's tokens interleaved with the chat template's rendering."""

from __future__ import annotations

import asyncio

import openai

from megatron_sao.rollout.chat_format import ChatFormat
from megatron_sao.rollout.trajectory import NO_POLICY_VERSION
from tests.rollout.engine_helpers import IM_END, cpu_engine, stoppy_checkpoint, tools_tokenizer
from tests.rollout.gateway.helpers import BASH_TOOL, RecordingClient, WholeTurnIsACall, action_spans, gateway_on

TOOL_OUTPUT = "README.md\nsetup.py"


async def _stream_message(stream) -> dict:
    """The assistant message an agent assembles from streamed chunks."""
    content, calls = "", {}
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            entry["function"]["name"] += call.function.name or ""
            entry["function"]["arguments"] += call.function.arguments or ""
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


async def _agent(url: str) -> None:
    client = RecordingClient(url)
    async with gateway_on([client], tool_format=WholeTurnIsACall()) as gateway:
        session = gateway.open_session("task-0")
        agent = openai.AsyncOpenAI(base_url=gateway.session_url(session), api_key="anything", max_retries=0)
        models = await agent.models.list()
        assert [m.id for m in models.data] == ["sao-policy"]

        messages: list = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List files."}]
        first = await agent.chat.completions.create(model="policy", messages=messages, tools=[BASH_TOOL],
                                                    max_tokens=200, seed=1)
        reply = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and reply.tool_calls[0].function.name == "bash"
        messages += [reply, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": TOOL_OUTPUT}]

        stream = await agent.chat.completions.create(model="policy", messages=messages, tools=[BASH_TOOL],
                                                     max_tokens=200, seed=2, stream=True,
                                                     stream_options={"include_usage": True})
        second = await _stream_message(stream)
        messages += [second, {"role": "user", "content": "Thanks. Anything else?"}]
        third = await agent.chat.completions.create(model="policy", messages=messages, tools=[BASH_TOOL],
                                                    max_tokens=200, seed=3, logprobs=True)
        await agent.close()

    (traj,) = session.segments
    chat = ChatFormat(tools_tokenizer())
    outputs = [out for _, out in client.calls]
    assert len(outputs) == 3 and all(out.output_ids[-1] == IM_END for out in outputs)
    a1, a2, a3 = (out.output_ids for out in outputs)

    # The scaffold saw the engine's own text.
    assert reply.tool_calls[0].function.arguments == _json_command(chat.decode_action(a1))
    assert second["tool_calls"][0]["function"]["arguments"] == _json_command(chat.decode_action(a2))
    assert [lp.logprob for lp in third.choices[0].logprobs.content] == outputs[2].output_logprobs

    # Token ids: the template's prompt, then each engine output, then the template's rendering of
    # what the scaffold added (the tool result; then the user message), loss mask 1 exactly on
    # the engine's tokens, log-probs and versions the engine's.
    prompt = chat.encode_prompt([dict(m) for m in messages[:2]], [BASH_TOOL])
    obs1 = chat.encode_observation(TOOL_OUTPUT, "tool", a1, [BASH_TOOL])
    obs2 = chat.encode_observation("Thanks. Anything else?", "user", a2, [BASH_TOOL])
    assert traj.token_ids == prompt + a1 + obs1 + a2 + obs2 + a3
    assert action_spans(traj) == [a1, a2, a3]
    assert traj.loss_mask == [0] * len(prompt) + [1] * len(a1) + [0] * len(obs1) + [1] * len(a2) + [0] * len(
        obs2) + [1] * len(a3)
    expected_lp = {i: lp for t, out in zip(traj.turns, outputs, strict=True)
                   for i, lp in zip(range(t.action_start, t.action_end), out.output_logprobs, strict=True)}
    assert all(traj.rollout_logprobs[i] == expected_lp.get(i, 0.0) for i in range(len(traj)))
    assert all(v == (0 if m else NO_POLICY_VERSION) for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True))
    # Every engine call continued exactly the record so far (no re-tokenisation).
    assert [inp for inp, _ in client.calls] == [traj.token_ids[:t.action_start] for t in traj.turns]

    # Independently of ChatFormat: the record decodes to the template's rendering of the whole
    # conversation (assistant turns as the engine wrote them).
    conversation = [dict(m) for m in messages[:2]]
    for action, after in ((a1, {"role": "tool", "content": TOOL_OUTPUT}),
                          (a2, {"role": "user", "content": "Thanks. Anything else?"}), (a3, None)):
        conversation.append({"role": "assistant", "content": chat.decode_action(action)})
        conversation += [after] if after else []
    rendered = chat.tokenizer.apply_chat_template(conversation, tokenize=False, tools=[BASH_TOOL])
    assert chat.tokenizer.decode(traj.token_ids, skip_special_tokens=False) == rendered.removesuffix("\n")
    assert [t["turn"] for t in traj.metadata["turn_timings"]] == [0, 1, 2]
    assert traj.metadata["segment"] == 0 and traj.metadata["segment_reason"] == "start"


def _json_command(text: str) -> str:
    import json

    return json.dumps({"command": text}, ensure_ascii=False)


def test_openai_agent_with_tool_call_is_recorded_token_exactly() -> None:
    with cpu_engine(stoppy_checkpoint()) as engine:
        asyncio.run(_agent(engine.url))
