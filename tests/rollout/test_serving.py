"""`rollout/serving.py`: the one composition of engines, pool and runner; its Protocols; episodes
in the order of their prompts."""

from __future__ import annotations

import asyncio

import pytest

from megatron_sao.pipeline.ray_engines import RayEngineSupervisor
from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig, AgentLoopStats
from megatron_sao.rollout.engine_supervisor import EngineConfig, EngineSupervisor
from megatron_sao.rollout.environment import PromptSample
from megatron_sao.rollout.gateway import ScaffoldRunner
from megatron_sao.rollout.serving import EngineFleet, Runner, Serving, run_episodes
from megatron_sao.rollout.trajectory import Trajectory, TrajectoryStatus
from tests.rollout.engine_helpers import tools_tokenizer


class _Fleet:
    """Engine processes that are not there: what `Serving` asks of them, recorded."""

    def __init__(self, fail_start: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_start = fail_start

    def start(self) -> list[str]:
        self.calls.append("start")
        if self.fail_start:
            raise RuntimeError("engine 0 never answered")
        return ["http://127.0.0.1:1", "http://127.0.0.1:2"]

    def start_monitor(self) -> None:
        self.calls.append("start_monitor")

    def alive(self, index: int) -> bool:
        return True

    def kill(self, index: int, sig: int = 9) -> None:
        self.calls.append(f"kill {index}")

    def total_restarts(self) -> int:
        return 0

    def set_weights(self, model_path: str, weight_version: str) -> None:
        self.calls.append("set_weights")

    def stop(self) -> None:
        self.calls.append("stop")


def _step_env(sample):
    raise AssertionError("no episode runs in these tests")


def _scaffold_env(sample):
    raise AssertionError("no episode runs in these tests")


_scaffold_env.driven_by_gateway = True  # what `envs.openai_scaffold`'s factory says of itself


def _serving(env_factory, fleet: _Fleet) -> Serving:
    return Serving(None, AgentLoopConfig(), tools_tokenizer(), env_factory, max_inflight_per_engine=3,
                   make_supervisor=lambda engine_config: fleet)


def test_the_engine_supervisors_and_runners_satisfy_the_protocols():
    assert isinstance(EngineSupervisor(EngineConfig(model_path="unused", backend="cpu")), EngineFleet)
    assert all(callable(getattr(RayEngineSupervisor, name)) for name in
               ("start", "start_monitor", "alive", "kill", "total_restarts", "set_weights", "stop"))
    for runner in (AgentLoop, ScaffoldRunner):
        assert all(callable(getattr(runner, name)) for name in ("iter_trajectories", "run", "abort"))


@pytest.mark.parametrize("env_factory, runner_type", [(_step_env, AgentLoop), (_scaffold_env, ScaffoldRunner)])
def test_serving_picks_the_runner_that_fits_and_closes_in_order(env_factory, runner_type):
    fleet = _Fleet()

    async def go() -> Serving:
        async with _serving(env_factory, fleet) as serving:
            assert isinstance(serving.runner, runner_type) and isinstance(serving.runner, Runner)
            assert [c.base_url for c in serving.pool.clients] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
            assert serving.pool.max_inflight_per_engine == 3 and fleet.calls == ["start", "start_monitor"]
        return serving

    serving = asyncio.run(go())
    assert fleet.calls == ["start", "start_monitor", "stop"] and serving.fleet is None
    with pytest.raises(RuntimeError, match="before open"):
        serving.runner  # noqa: B018


def test_a_failed_engine_start_stops_what_it_started():
    fleet = _Fleet(fail_start=True)

    async def go() -> None:
        async with _serving(_step_env, fleet):
            raise AssertionError("not reached")

    with pytest.raises(RuntimeError, match="never answered"):
        asyncio.run(go())
    assert fleet.calls == ["start", "stop"]


class _SegmentedRunner:
    """Episodes finishing in reverse order, the second in two segments (a rewritten history)."""

    stats = AgentLoopStats()

    async def iter_trajectories(self, samples):
        for sample in reversed(list(samples)):
            segments = 2 if sample.prompt_id == "b" else 1
            for k in range(segments):
                traj = Trajectory(prompt_id=sample.prompt_id,
                                  metadata={**sample.metadata, "segment": k, "last_segment": k == segments - 1})
                traj.finish(TrajectoryStatus.COMPLETED, "done")
                yield traj

    async def run(self, samples):
        return [t async for t in self.iter_trajectories(samples)]

    async def abort(self) -> None:
        pass


def test_run_episodes_gives_one_trajectory_per_sample_in_their_order():
    samples = [PromptSample(prompt_id=p, messages=[{"role": "user", "content": p}]) for p in ("a", "b", "a")]
    episodes = asyncio.run(run_episodes(_SegmentedRunner(), samples))
    assert [t.prompt_id for t in episodes] == ["a", "b", "a"] and episodes[0] is not episodes[2]
    assert episodes[1].metadata["segment"] == 1  # the episode's last segment
    assert all("serving_index" not in t.metadata for t in episodes)
