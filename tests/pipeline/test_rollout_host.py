"""`RolloutHost` builds the rollout its config describes (no engine is started here)."""

from __future__ import annotations

import asyncio

import pytest

from megatron_sao.pipeline.rollout_actor import RolloutHost
from tests.pipeline.test_engine_training import _engine_config


async def _reset_within(env, sample, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(env.reset(sample), timeout_s)
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("barrier", [False, True])
def test_pipeline_barrier_gates_each_episode_on_the_trainers_round(tmp_path, tiny_hf_dir, barrier):
    host = RolloutHost(_engine_config(tmp_path, tiny_hf_dir, "host", f"pipeline.barrier={str(barrier).lower()}"),
                       tmp_path / "run")
    assert host.buffer.barrier is barrier
    sample = next(iter(host.service.prompts))
    env = host.service.env_factory(sample)
    # Asynchronous: an episode starts at once. Synchronous: it waits until the trainer asks for a
    # batch (which opens a round of data.batch_size permits).
    assert asyncio.run(_reset_within(env, sample, 0.5)) is not barrier
    if barrier:
        assert host.buffer.take(4, actor_version=0, timeout_s=0.05) is None  # opens the round, nothing ready yet
        assert asyncio.run(_reset_within(host.service.env_factory(sample), sample, 5.0))
