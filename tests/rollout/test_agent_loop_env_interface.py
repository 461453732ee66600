"""What the agent loop takes from the Environment interface, against a scripted engine: an awaited
`reset` that may do I/O without stalling other episodes, an environment's own truncation
(`StepResult.truncated`) and its reward, and the tools an environment declares reaching the prompt
tokens through the chat template."""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar

import pytest
from transformers import AutoTokenizer

from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.environment import TRUNCATION_REASON_KEY, Environment, PromptSample, StepResult
from megatron_sao.rollout.envs.calc import CALL_CLOSE, CALL_OPEN, generate_calc_samples, make_calc
from megatron_sao.rollout.trajectory import RewardKind, TrajectoryStatus
from tests.rollout.engine_helpers import (
    IM_END,
    Answer,
    ScriptedEngine,
    ScriptedEnv,
    sample,
    tiny_checkpoint,
    tools_tokenizer,
)

TOKENIZER = AutoTokenizer.from_pretrained(tiny_checkpoint())
TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run Python.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _engine(num_turns: int) -> ScriptedEngine:
    """An engine that answers every call with `ok<|im_end|>` (a closed turn)."""
    ok = TOKENIZER.encode("ok", add_special_tokens=False)
    return ScriptedEngine(answers=[Answer([*ok, IM_END], "stop", None) for _ in range(num_turns)])


def _loop(engine: ScriptedEngine, env_factory, tokenizer=TOKENIZER, **config) -> AgentLoop:
    return AgentLoop(AgentLoopConfig(**{"max_turns": 4, **config}), tokenizer, EnginePool([engine]), env_factory)


def test_reset_is_awaited_and_does_not_block_other_episodes():
    """Each episode's reset waits until the other's has started: only an awaited reset running
    concurrently on the event loop gets both past it (a blocking reset would time out)."""
    started: list[str] = []
    both_started = asyncio.Event()

    class SlowReset(ScriptedEnv):
        async def reset(self, s: PromptSample) -> list[dict[str, str]]:
            started.append(s.prompt_id)
            if len(started) == 2:
                both_started.set()
            await asyncio.wait_for(both_started.wait(), 5.0)
            await asyncio.sleep(0.05)  # e.g. a container starting
            return [{"role": "user", "content": f"task of {s.prompt_id}"}]

    loop = _loop(_engine(2), lambda s: SlowReset(done_after=1), max_concurrent_trajectories=2)
    trajs = {t.prompt_id: t for t in asyncio.run(loop.run([sample("a"), sample("b")]))}
    assert {t.status for t in trajs.values()} == {TrajectoryStatus.COMPLETED}, [t.status_reason for t in trajs.values()]
    for pid, traj in trajs.items():
        assert TOKENIZER.decode(traj.token_ids[: traj.prompt_length]).startswith(f"<|im_start|>user\ntask of {pid}")
        assert traj.timings.env_s >= 0.05  # reset time is environment time


class Truncating(ScriptedEnv):
    """Ends the episode by its own budget after `done_after` turns with `reward`."""

    def __init__(self, reward: float, info: dict, done_after: int = 2) -> None:
        super().__init__(done_after=done_after)
        self.reward, self.info = reward, info

    async def step(self, action_text: str) -> StepResult:
        result = await super().step(action_text)
        if not result.done:
            return result
        return StepResult(observation="", reward=self.reward, done=True, truncated=True, info=self.info)


@pytest.mark.parametrize(("reward", "info", "reason"), [
    (0.3, {TRUNCATION_REASON_KEY: "tool_budget"}, "env_truncated: tool_budget"),
    (0.0, {}, "env_truncated"),
])
def test_environment_truncation_keeps_the_environment_reward(reward: float, info: dict, reason: str):
    env = Truncating(reward, info)
    loop = _loop(_engine(2), lambda s: env, truncation_reward=-1.0)
    traj = asyncio.run(loop.run_trajectory(sample()))
    traj.validate()
    assert traj.status == TrajectoryStatus.TRUNCATED and traj.status_reason == reason
    assert len(traj.turns) == 2 and env.closed
    # the environment scored the episode when it cut it short: its reward (even 0.0), not -1.0
    terminal = [r for r in traj.rewards if r.kind == RewardKind.TERMINAL]
    assert [r.value for r in terminal] == [reward] and terminal[0].position == traj.turns[-1].action_end - 1
    assert loop.stats.by_status == {"truncated": 1}


def test_calc_turn_limit_is_recorded_as_truncated_with_its_graded_reward():
    """The calculator task ends and scores the episode itself after its `max_turns` calls."""
    calc = generate_calc_samples(1, seed=0)[0]
    call = TOKENIZER.encode(f"{CALL_OPEN}{calc.metadata['expression']}{CALL_CLOSE}", add_special_tokens=False)
    engine = ScriptedEngine(answers=[Answer([*call, IM_END], "stop", None) for _ in range(2)])
    loop = _loop(engine, make_calc(max_turns=2), truncation_reward=-1.0)
    traj = asyncio.run(loop.run_trajectory(calc))
    traj.validate()
    assert traj.status == TrajectoryStatus.TRUNCATED and traj.status_reason == "env_truncated: max_turns"
    assert traj.terminal_reward == pytest.approx(0.2)  # the tool credit calc gives, not truncation_reward


def test_truncation_by_the_loop_still_gets_truncation_reward():
    loop = _loop(_engine(2), lambda s: ScriptedEnv(done_after=10), truncation_reward=-1.0, max_turns=2)
    traj = asyncio.run(loop.run_trajectory(sample()))
    assert traj.status == TrajectoryStatus.TRUNCATED and traj.status_reason == "max_turns"
    assert traj.terminal_reward == -1.0


def test_truncated_requires_done():
    with pytest.raises(ValueError, match="done=True"):
        StepResult(observation="x", truncated=True)


class WithTools(ScriptedEnv):
    tools = TOOLS  # a class attribute overrides the base class's property


def test_declared_tools_reach_the_prompt_and_the_observations():
    tokenizer = tools_tokenizer()
    engine = _engine(2)
    loop = _loop(engine, lambda s: WithTools(done_after=2, observations=["4"]), tokenizer=tokenizer)
    traj = asyncio.run(loop.run_trajectory(sample("p", "2+2?")))
    assert traj.status == TrajectoryStatus.COMPLETED, traj.status_reason
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "ok"},
                {"role": "tool", "content": "4"}]
    first_input, second_input = engine.calls[0][0], engine.calls[1][0]
    assert tokenizer.decode(first_input).startswith(f"<|im_start|>system\n# Tools\n{json.dumps(TOOLS[0])}\n")
    assert first_input == tokenizer.apply_chat_template(messages[:1], tools=TOOLS, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
    # the whole conversation, re-rendered with the tools, is what the second turn was given
    assert second_input == tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)


def test_an_environment_without_tools_renders_as_before():
    tokenizer = tools_tokenizer()  # renders tools if any were passed
    engine = _engine(1)
    traj = asyncio.run(_loop(engine, lambda s: ScriptedEnv(done_after=1), tokenizer=tokenizer).run_trajectory(sample()))
    assert traj.status == TrajectoryStatus.COMPLETED
    assert tokenizer.decode(engine.calls[0][0]) == "<|im_start|>user\nCompute 2+2.<|im_end|>\n<|im_start|>assistant\n"


def test_malformed_tools_fail_the_trajectory_at_reset():
    class BadTools(ScriptedEnv):
        tools: ClassVar = {"name": "python"}  # a schema, not a list of schemas

    engine = _engine(1)
    loop = _loop(engine, lambda s: BadTools())
    traj = asyncio.run(loop.run_trajectory(sample()))
    assert traj.status == TrajectoryStatus.FAILED and traj.status_reason.startswith("env_reset_error: tools must be")
    assert not engine.calls


def test_a_synchronous_reset_is_refused_when_the_class_is_defined():
    with pytest.raises(TypeError, match=r"Old\.reset must be a coroutine"):
        class Old(Environment):
            def reset(self, sample: PromptSample) -> list[dict[str, str]]:
                return sample.messages

            async def step(self, action_text: str) -> StepResult:
                return StepResult(observation="", done=True)
