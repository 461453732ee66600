"""Demonstrations: episodes of a scripted policy, recorded exactly as the agent loop records a model's.

SFT warm-starts the policy on what a teacher does (e.g. `envs.calc.oracle_action`). The teacher
plays the environment through the same steps as `AgentLoop` (`reset`, the chat template's prompt,
one action per turn closed by the turn's stop token, the environment's observation rendered by
`ChatFormat.encode_observation`, rewards credited the same way), so a model trained on these
records emits exactly the token sequences the agent loop parses later. The teacher's tokens have
no sampling log-probs: they are recorded as 0.0 (probability 1) with policy version 0, which SFT
ignores (it reads tokens and `loss_mask` only); do not train RL on them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from megatron_sao.rollout.chat_format import ChatFormat
from megatron_sao.rollout.environment import Environment, PromptSample
from megatron_sao.rollout.trajectory import FinishType, RewardKind, Trajectory, TrajectoryStatus

Teacher = Callable[[PromptSample, list[str]], str]
"""(sample, observations so far) -> the next action's text."""


async def demonstrate(sample: PromptSample, env: Environment, teacher: Teacher, chat: ChatFormat,
                      max_turns: int) -> Trajectory:
    """One episode of `teacher` on `env`, recorded token by token."""
    traj = Trajectory(prompt_id=sample.prompt_id, metadata={**sample.metadata, "demonstration": True})
    messages = await env.reset(sample)
    tools = env.tools
    traj.set_prompt(chat.encode_prompt(messages, tools))
    observations: list[str] = []
    stop = chat.stop_token_ids[0]
    try:
        for _ in range(max_turns):
            action_ids = [*chat.encode(teacher(sample, observations)), stop]
            traj.append_action(action_ids, [0.0] * len(action_ids), [0] * len(action_ids), FinishType.STOP)
            result = await env.step(chat.decode_action(action_ids))
            if result.done:
                traj.add_reward(result.reward, RewardKind.TERMINAL)
                traj.finish(TrajectoryStatus.TRUNCATED if result.truncated else TrajectoryStatus.COMPLETED)
                return traj
            if result.reward:
                traj.add_reward(result.reward, RewardKind.TURN)
            observations.append(result.observation)
            traj.append_observation(chat.encode_observation(result.observation, result.role, action_ids, tools))
        traj.finish(TrajectoryStatus.TRUNCATED, "max_turns")
        return traj
    finally:
        await env.close()


def demonstrations(samples: Sequence[PromptSample], env_factory: Callable[[PromptSample], Environment],
                   teacher: Teacher, tokenizer, max_turns: int) -> list[Trajectory]:
    """Every sample's demonstration, in order (each validated)."""
    chat = ChatFormat(tokenizer)

    async def run() -> list[Trajectory]:
        return [await demonstrate(s, env_factory(s), teacher, chat, max_turns) for s in samples]

    out = asyncio.run(run())
    for traj in out:
        traj.validate()
    return out
