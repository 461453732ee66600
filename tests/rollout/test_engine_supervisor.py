"""The engine supervisor: SGLang command lines from the config, clear errors, and a crashed CPU
engine restarted while the agent loop re-sends its in-flight calls (no trajectory lost)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest
from transformers import AutoTokenizer

from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig
from megatron_sao.rollout.client import EngineClient
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.engine_supervisor import EngineConfig, EngineSupervisor
from megatron_sao.rollout.environment import StepResult
from megatron_sao.rollout.trajectory import TrajectoryStatus
from tests.rollout.engine_helpers import ScriptedEnv, sample, stoppy_checkpoint


def test_sglang_command_carries_the_parallel_layout():
    config = EngineConfig(
        backend="sglang",
        model_path="/ckpt/hf",
        num_engines=2,
        tp_size=4,
        ep_size=2,
        dp_size=2,
        base_gpu_id=0,
        mem_fraction_static=0.7,
        enable_memory_saver=True,
        weight_version="3",
        random_seed=10,
        extra_args=["--attention-backend", "fa3"],
    )
    assert config.gpus_per_engine == 8
    cmd = EngineSupervisor(config).command(1, 31001)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--model-path"] == "/ckpt/hf" and flags["--port"] == "31001"
    assert (flags["--tp-size"], flags["--ep-size"], flags["--dp-size"]) == ("4", "2", "2")
    assert flags["--base-gpu-id"] == "8" and flags["--weight-version"] == "3" and flags["--random-seed"] == "11"
    assert "--enable-memory-saver" in cmd and "--skip-server-warmup" in cmd
    assert cmd[-2:] == ["--attention-backend", "fa3"] and "--mem-fraction-static" in cmd


def test_restarts_load_the_latest_published_weights():
    supervisor = EngineSupervisor(EngineConfig(model_path="/ckpt/v0"))
    supervisor.set_weights("/ckpt/v7", "7")
    cmd = supervisor.command(0, 30000)
    assert cmd[cmd.index("--model") + 1] == "/ckpt/v7" and cmd[cmd.index("--weight-version") + 1] == "7"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model_path": ""}, "model_path"),
        ({"backend": "vllm"}, "backend"),
        ({"num_engines": 0}, "num_engines"),
        ({"tp_size": 4, "ep_size": 3, "backend": "sglang"}, "ep_size"),
        ({"tp_size": 2}, "CPU engine"),
    ],
)
def test_bad_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineSupervisor(EngineConfig(**{"model_path": "/m", **overrides}))


def test_sglang_backend_without_sglang_names_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(ImportError, match=r"sglang==0\.5\.23"):
        EngineSupervisor(EngineConfig(backend="sglang", model_path="/m")).start()


class SlowEnv(ScriptedEnv):
    async def step(self, action_text: str) -> StepResult:
        await asyncio.sleep(0.02)
        return await super().step(action_text)


# slow (~25 s): tests/pipeline/test_engine_faults.py::test_killed_engine_loses_nothing kills an engine mid-run
# in the default suite (restart, re-sent calls, nothing lost, weights re-synced).
@pytest.mark.slow
def test_crashed_engine_is_restarted_and_its_trajectories_requeued(tmp_path):
    config = EngineConfig(model_path=str(stoppy_checkpoint()), num_engines=2, log_dir=str(tmp_path), max_restarts=2)
    tokenizer = AutoTokenizer.from_pretrained(stoppy_checkpoint())
    with EngineSupervisor(config) as supervisor:
        supervisor.start_monitor(interval_s=0.2)
        clients = [EngineClient(url) for url in supervisor.urls]
        loop = AgentLoop(
            AgentLoopConfig(max_turns=30, max_new_tokens_per_turn=128, max_total_tokens=4096),
            tokenizer,
            EnginePool(clients, probe_interval_s=0.2),
            lambda s: SlowEnv(done_after=30),
        )

        async def go():
            task = asyncio.create_task(loop.run([sample(f"p{i}") for i in range(12)]))
            while (await clients[0].get_server_info())["internal_states"][0]["num_running_reqs"] == 0:
                await asyncio.sleep(0.01)
            supervisor.kill(0)  # SIGKILL the whole engine process group mid-generation
            trajs = await asyncio.wait_for(task, 180)
            healthy = [await c.health_generate() for c in clients]
            return trajs, healthy

        trajs, healthy = asyncio.run(go())
        assert supervisor.engines[0].restarts == 1 and supervisor.engines[1].restarts == 0
    assert healthy == [True, True]
    assert len(trajs) == 12
    assert sum(t.num_engine_retries for t in trajs) >= 1  # calls in flight on engine 0 were re-sent
    for traj in trajs:
        traj.validate()
        assert traj.status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED), traj.status_reason
    assert all(h.process is not None and h.process.poll() is not None for h in supervisor.engines)  # stopped
