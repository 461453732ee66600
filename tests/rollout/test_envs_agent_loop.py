"""The calculator task through the real agent loop and a randomly initialised tiny model on the
CPU engine: what the CPU demo starts from. The random model must already see a graded,
non-zero reward, and the loop must record exactly the reward the environment computed."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig
from megatron_sao.rollout.client import EngineClient
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.envs import make_env_factory
from megatron_sao.rollout.envs.calc import generate_calc_samples
from megatron_sao.rollout.trajectory import TrajectoryStatus
from tests.rollout.engine_helpers import cpu_engine, stoppy_checkpoint


@pytest.fixture(scope="module")
def trajectories() -> list:
    checkpoint = stoppy_checkpoint()  # the tiny random model, made to close its turns now and then
    with cpu_engine(checkpoint) as server:
        loop = AgentLoop(AgentLoopConfig(max_turns=3, max_new_tokens_per_turn=24, max_total_tokens=512),
                         AutoTokenizer.from_pretrained(checkpoint), EnginePool([EngineClient(server.url)]),
                         make_env_factory("calc"))
        return asyncio.run(loop.run(generate_calc_samples(48, seed=0)))


def test_random_tiny_model_gets_graded_nonzero_rewards(trajectories: list) -> None:
    statuses = {t.status for t in trajectories}
    assert statuses <= {TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED}, \
        [t.status_reason for t in trajectories]
    completed = [t for t in trajectories if t.status == TrajectoryStatus.COMPLETED]
    assert len(completed) >= len(trajectories) // 2
    rewards = [t.terminal_reward for t in completed]
    assert sum(r > 0 for r in rewards) >= len(completed) // 2
    assert len({round(r, 4) for r in rewards}) >= 5  # graded
    # the environment's score is the terminal reward whenever the environment ended the episode,
    # also when it cut it short itself (its turn limit: TRUNCATED "env_truncated: max_turns")
    scored_by_env = completed + [t for t in trajectories if t.status_reason.startswith("env_truncated")]
    for traj in scored_by_env:
        assert traj.terminal_reward == traj.metadata["last_step_info"]["reward"]
