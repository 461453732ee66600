"""32 scaffold sessions at once on one real CPU engine: every turn of every session recorded in
its own trajectory, none lost or crossed."""

from __future__ import annotations

import asyncio

import openai

from megatron_sao.rollout.chat_format import ChatFormat
from tests.rollout.engine_helpers import cpu_engine, stoppy_checkpoint, tools_tokenizer
from tests.rollout.gateway.helpers import RecordingClient, action_spans, gateway_on

NUM_SESSIONS = 32


async def _agent(gateway, index: int):
    session = gateway.open_session(f"p{index}", {"index": index})
    agent = openai.AsyncOpenAI(base_url=gateway.session_url(session), api_key="k", max_retries=0)
    messages = [{"role": "user", "content": f"Task {index}: say something."}]
    replies = []
    for turn in range(2):
        reply = await agent.chat.completions.create(model="m", messages=messages, max_tokens=24, seed=index * 10 + turn)
        replies.append(reply.choices[0])
        messages += [reply.choices[0].message, {"role": "user", "content": f"Go on ({index}, {turn})."}]
    await agent.close()
    return session, replies


async def _many(url: str):
    client = RecordingClient(url)
    async with gateway_on([client]) as gateway:
        results = await asyncio.gather(*(_agent(gateway, i) for i in range(NUM_SESSIONS)))
        assert gateway.sessions.keys() == {s.session_id for s, _ in results}
    return client, results


def test_32_concurrent_sessions_lose_nothing() -> None:
    with cpu_engine(stoppy_checkpoint(), max_running_requests=32) as engine:
        client, results = asyncio.run(_many(engine.url))
    chat = ChatFormat(tools_tokenizer())
    outputs = {tuple(inp): out for inp, out in client.calls}
    assert len(client.calls) == 2 * NUM_SESSIONS
    for index, (session, replies) in enumerate(results):
        (traj,) = session.segments  # nothing rewritten: one segment per session
        traj.validate()
        assert traj.metadata["index"] == index and len(traj.turns) == 2
        prompt = chat.encode_prompt([{"role": "user", "content": f"Task {index}: say something."}])
        assert traj.token_ids[: traj.prompt_length] == prompt
        for turn, action, reply in zip(traj.turns, action_spans(traj), replies, strict=True):
            out = outputs[tuple(traj.token_ids[: turn.action_start])]  # the engine call that sampled it
            assert action == out.output_ids and traj.rollout_logprobs[turn.action_start:turn.action_end] == \
                out.output_logprobs
            text = chat.decode_action(action)
            assert reply.message.content == text
            assert reply.finish_reason == ("stop" if chat.ends_with_stop(action) else "length")
