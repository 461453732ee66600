"""The agent loop records routed experts (R3): every token of a multi-turn trajectory but the last
carries the experts the engine routed it to, also when turns are aborted and resumed; each call
asks only for the positions the trajectory has no routing for yet."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from megatron_sao.cpu_engine.model_runner import ModelRunner
from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig
from megatron_sao.rollout.client import EngineClient
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.routing import routing_spec_from_hf_config
from megatron_sao.rollout.trajectory import Trajectory, TrajectoryStatus
from tests.rollout.engine_helpers import ScriptedEnv, cpu_engine, sample, stoppy_checkpoint


@pytest.fixture(scope="module")
def engine():
    with cpu_engine(stoppy_checkpoint(), enable_return_routed_experts=True) as server:
        yield server


@pytest.fixture(scope="module")
def spec():
    return routing_spec_from_hf_config(json.loads((stoppy_checkpoint() / "config.json").read_text()))


@pytest.fixture(scope="module")
def reference() -> ModelRunner:
    return ModelRunner(stoppy_checkpoint(), capture_routing=True)


class CountingClient(EngineClient):
    """Records the `routed_experts_start_len` of every call."""

    starts: list[tuple[int, int]]

    async def generate(self, input_ids, sampling_params, rid=None, return_logprob=True,
                       return_routed_experts=False, routed_experts_start_len=0, **extra):
        self.starts.append((len(input_ids), routed_experts_start_len if return_routed_experts else -1))
        return await super().generate(input_ids, sampling_params, rid, return_logprob, return_routed_experts,
                                      routed_experts_start_len, **extra)


def routed_like_a_plain_forward(reference: ModelRunner, traj: Trajectory) -> float:
    """Share of the routed tokens whose experts equal those of one plain forward of the record."""
    with torch.inference_mode(), reference.routing.recording(1, len(traj)) as routing_bslk:
        reference.model(input_ids=torch.tensor([traj.token_ids]))
    plain = np.sort(routing_bslk[0].numpy(), axis=-1)
    mask = traj.routed_experts.routed_mask()
    got = np.sort(traj.routed_experts.indices_nlk, axis=-1)
    return float((got[mask] == plain[mask]).all(axis=(1, 2)).mean())


def make_loop(engine_url: str, spec, env_factory, **config) -> tuple[AgentLoop, CountingClient]:
    client = CountingClient(engine_url)
    client.starts = []
    defaults = {"max_turns": 6, "max_new_tokens_per_turn": 96, "max_total_tokens": 1024, "routing": spec}
    loop = AgentLoop(AgentLoopConfig(**{**defaults, **config}), AutoTokenizer.from_pretrained(stoppy_checkpoint()),
                     EnginePool([client]), env_factory)
    return loop, client


def test_every_token_but_the_last_is_routed(engine, spec, reference):
    loop, client = make_loop(engine.url, spec, lambda s: ScriptedEnv(done_after=3))
    trajs = asyncio.run(loop.run([sample(f"p{i}", f"Task {i}.") for i in range(4)]))
    multi_turn = 0
    for traj in trajs:
        assert traj.status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED), traj.status_reason
        traj.validate()
        routed = traj.routed_experts
        assert routed.num_tokens == len(traj) and (routed.num_layers, routed.topk) == (spec.num_moe_layers, spec.topk)
        assert routed.routed_mask()[:-1].all() and not routed.routed_mask()[-1]
        assert routed_like_a_plain_forward(reference, traj) >= 0.99  # fp32: the same experts
        multi_turn += len(traj.turns) > 1
    assert multi_turn >= 1
    # A later turn asks only for the positions after those already routed (the previous call's
    # last token, then the observation): never the whole history again.
    later = [(n, start) for n, start in client.starts if start > 0]
    assert later and all(n - 40 < start < n for n, start in later)


def test_aborted_and_resumed_turns_keep_every_tokens_routing(engine, spec, reference):
    loop, _ = make_loop(engine.url, spec, lambda s: ScriptedEnv(done_after=20), max_turns=20, max_total_tokens=2048)
    control = EngineClient(engine.url)

    async def go():
        task = asyncio.create_task(loop.run([sample(f"p{i}") for i in range(6)]))
        for _ in range(3):
            while not task.done() and (await control.get_server_info())["internal_states"][0]["num_running_reqs"] < 2:
                await asyncio.sleep(0.005)
            await control.pause_generation(mode="abort")
            await asyncio.sleep(0.05)
            await control.continue_generation()
        return await asyncio.wait_for(task, 120)

    trajs = asyncio.run(go())
    assert sum(t.num_engine_retries for t in trajs) >= 1
    for traj in trajs:
        traj.validate()
        assert traj.routed_experts.routed_mask()[:-1].all()
        assert routed_like_a_plain_forward(reference, traj) >= 0.99
