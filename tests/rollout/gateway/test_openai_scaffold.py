"""The `openai_scaffold` environment run by `ScaffoldRunner`: scaffold processes written with the
`openai` client, their tool running in the sandbox, a verifier's reward; crashes and timeouts."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig
from megatron_sao.rollout.chat_format import ChatFormat
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.envs import make_env_factory
from megatron_sao.rollout.gateway import ScaffoldRunner, make_runner
from megatron_sao.rollout.trajectory import TrajectoryStatus
from tests.rollout.engine_helpers import IM_END, Answer, ScriptedEngine, sample, tools_tokenizer

SCAFFOLD = textwrap.dedent('''
    import json, os, subprocess, sys
    from openai import OpenAI

    task = json.load(open(os.environ["SAO_TASK_FILE"]))
    tools = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
    client = OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    messages = list(task["messages"])
    while True:
        reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, tools=tools)
        message = reply.choices[0].message
        messages.append(message)
        if os.environ.get("CRASH_AFTER_FIRST_TURN"):
            sys.exit(3)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            code = json.loads(call.function.arguments)["code"]
            run = subprocess.run(os.environ["SAO_SANDBOX_EXEC"], shell=True, input=code, capture_output=True,
                                 text=True)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run.stdout.strip()})
    open("answer.txt", "w").write(message.content.split()[-1].rstrip("."))
''')
VERIFIER = [sys.executable, "-c", "print(1.0 if open('answer.txt').read() == '42' else 0.0)"]
CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'


def _tokens(text: str) -> list[int]:
    return [*tools_tokenizer().encode(text, add_special_tokens=False), IM_END]


def _run_episodes(factory, engine, samples, **config):
    async def go():
        runner = ScaffoldRunner(AgentLoopConfig(**config), tools_tokenizer(), EnginePool([engine]), factory)
        try:
            return await runner.run(samples)
        finally:
            await runner.close()

    return asyncio.run(go())


def _scaffold(tmp_path: Path) -> str:
    path = tmp_path / "scaffold.py"
    path.write_text(SCAFFOLD)
    return str(path)


def test_scaffold_episode_with_sandboxed_tool_and_verifier(tmp_path: Path) -> None:
    a1, a2 = _tokens("Computing.\n" + CALL), _tokens("The answer is 42.")
    engine = ScriptedEngine([Answer(a1, "stop", None), Answer(a2, "stop", None)])
    factory = make_env_factory("openai_scaffold", command=[sys.executable, _scaffold(tmp_path)],
                               verifier_command=VERIFIER, timeout_s=120)
    (traj,) = _run_episodes(factory, engine, [sample("p0", "What is 6*7? Use python.")])
    assert traj.status == TrajectoryStatus.COMPLETED, traj.status_reason
    assert traj.terminal_reward == 1.0 and traj.rewards[0].position == len(traj) - 1
    chat = ChatFormat(tools_tokenizer())
    prompt = chat.encode_prompt(sample("p0", "What is 6*7? Use python.").messages, [
        {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}])
    tools = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
    assert traj.token_ids == prompt + a1 + chat.encode_observation("42", "tool", a1, tools) + a2
    traj.validate()
    timings = traj.metadata["turn_timings"]
    assert len(timings) == 2 and timings[1]["scaffold_s"] > 0  # the sandboxed tool ran between the turns
    assert traj.metadata["scaffold"]["exit_code"] == 0 and traj.metadata["last_segment"] is True
    assert traj.timings.env_s == pytest.approx(sum(t["scaffold_s"] for t in timings), abs=1e-5)  # rounded to 1 us


def test_scaffold_crash_fails_the_episode_with_the_reason(tmp_path: Path) -> None:
    engine = ScriptedEngine([Answer(_tokens("hi"), "stop", None)])
    factory = make_env_factory("openai_scaffold", command=[sys.executable, _scaffold(tmp_path)],
                               env={"PATH": "/usr/bin:/bin", "CRASH_AFTER_FIRST_TURN": "1"}, timeout_s=120)
    (traj,) = _run_episodes(factory, engine, [sample()])
    assert traj.status == TrajectoryStatus.FAILED
    assert traj.status_reason.startswith("scaffold_crashed: exit code 3")
    assert len(traj.turns) == 1 and traj.rewards == []


def test_scaffold_timeout_kills_it(tmp_path: Path) -> None:
    factory = make_env_factory("openai_scaffold", command=[sys.executable, "-c", "import time; time.sleep(60)"],
                               timeout_s=1.0)
    start = time.perf_counter()
    (traj,) = _run_episodes(factory, ScriptedEngine([]), [sample()])
    assert time.perf_counter() - start < 15
    assert traj.status == TrajectoryStatus.FAILED and traj.status_reason.startswith("scaffold_timeout: > 1 s")


def test_concurrency_is_bounded_and_every_prompt_is_accounted_for(tmp_path: Path) -> None:
    log = tmp_path / "spans.txt"
    probe = f"import time; s = time.time(); time.sleep(0.4); open({str(log)!r}, 'a').write(f'{{s}} {{time.time()}}\\n')"
    factory = make_env_factory("openai_scaffold", command=[sys.executable, "-c", probe], max_concurrent=2)
    trajs = _run_episodes(factory, ScriptedEngine([]), [sample(f"p{i}") for i in range(5)])
    assert sorted(t.prompt_id for t in trajs) == [f"p{i}" for i in range(5)]
    assert all(t.status_reason.startswith("no_model_call") for t in trajs)
    spans = [tuple(map(float, line.split())) for line in log.read_text().splitlines()]
    overlap = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert len(spans) == 5 and overlap <= 2


def test_agent_loop_refuses_the_scaffold_environment_by_name() -> None:
    factory = make_env_factory("openai_scaffold", command=["true"], model_name="policy-x", tool_call_format="glm")
    pool = EnginePool([ScriptedEngine([])])
    runner = make_runner(AgentLoopConfig(max_turns=7), tools_tokenizer(), pool, factory)
    assert isinstance(runner, ScaffoldRunner) and runner.gateway.config.model_name == "policy-x"
    assert runner.gateway.tool_format.name == "glm" and runner.gateway.config.limits.max_turns == 7
    loop = make_runner(AgentLoopConfig(), tools_tokenizer(), pool, make_env_factory("calc"))
    assert isinstance(loop, AgentLoop)
    traj = asyncio.run(AgentLoop(AgentLoopConfig(), tools_tokenizer(), pool, factory).run_trajectory(sample()))
    assert traj.status == TrajectoryStatus.FAILED and "ScaffoldRunner" in traj.status_reason
