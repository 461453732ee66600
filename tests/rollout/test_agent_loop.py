"""The agent loop against a real CPU engine: multi-turn trajectories whose action log-probs are
the model's own (token-in / token-out), weight updates mid-trajectory, failures, truncation,
abort, engine-side aborts, and many trajectories in flight."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from megatron_sao.cpu_engine.model_runner import ModelRunner
from megatron_sao.rollout.agent_loop import FAILURE_INFO_KEYS, AgentLoop, AgentLoopConfig, parse_policy_version
from megatron_sao.rollout.client import EngineClient
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.environment import StepResult
from megatron_sao.rollout.trajectory import RewardKind, Trajectory, TrajectoryStatus
from megatron_sao.rollout.weight_transfer import SAFETENSORS_LOAD_FORMAT, encode_safetensors_payload
from tests.rollout.engine_helpers import IM_END, ScriptedEnv, cpu_engine, sample, stoppy_checkpoint

LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def engine():
    with cpu_engine(stoppy_checkpoint()) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(stoppy_checkpoint())


@pytest.fixture(scope="module")
def reference() -> ModelRunner:
    return ModelRunner(stoppy_checkpoint())


def make_loop(engine_url: str, tokenizer, env_factory, **config) -> AgentLoop:
    defaults = {"max_turns": 6, "max_new_tokens_per_turn": 96, "max_total_tokens": 1024}
    return AgentLoop(
        AgentLoopConfig(**{**defaults, **config}), tokenizer, EnginePool([EngineClient(engine_url)]), env_factory
    )


def action_logprobs_match_the_model(reference: ModelRunner, traj: Trajectory) -> None:
    with torch.inference_mode():
        logits = reference.model(input_ids=torch.tensor([traj.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    for t, m in enumerate(traj.loss_mask):
        if m:
            assert abs(traj.rollout_logprobs[t] - float(logp[t - 1, traj.token_ids[t]])) <= LOGPROB_TOL


def test_multi_turn_trajectories_are_exact(engine, tokenizer, reference):
    envs: list[ScriptedEnv] = []

    def factory(s):
        envs.append(ScriptedEnv(done_after=3, terminal_reward=1.0, turn_rewards=[0.5, 0.0]))
        return envs[-1]

    loop = make_loop(engine.url, tokenizer, factory)
    trajs = asyncio.run(loop.run([sample(f"p{i}", f"Task {i}: add {i} and 2.") for i in range(8)]))
    completed = [t for t in trajs if t.status == TrajectoryStatus.COMPLETED]
    assert len(completed) >= 4, [t.status_reason for t in trajs]
    for traj in trajs:
        traj.validate()
        action_logprobs_match_the_model(reference, traj)  # token-in / token-out: nothing re-tokenised
        assert set(traj.action_versions()) == {0}
    for traj in completed:
        assert len(traj.turns) == 3 and traj.terminal_reward == 1.0
        assert [r.kind for r in traj.rewards] == [RewardKind.TURN, RewardKind.TERMINAL]
        assert traj.rewards[0].position == traj.turns[0].action_end - 1
        for turn in traj.turns:
            assert traj.token_ids[turn.action_end - 1] == IM_END  # the model closed its turn
        first_obs = traj.token_ids[traj.turns[0].action_end : traj.turns[0].observation_end]
        assert tokenizer.decode(first_obs) == "\n<|im_start|>tool\nobservation 0<|im_end|>\n<|im_start|>assistant\n"
    assert all(env.closed for env in envs)
    assert sum(loop.stats.by_status.values()) == 8


def test_weight_update_mid_trajectory_versions_later_tokens(engine, tokenizer, reference):
    new_weights = {k: v.clone() for k, v in reference.model.state_dict().items() if k == "model.norm.weight"}
    new_weights["model.norm.weight"] *= 1.0  # same values: the record stays checkable against `reference`

    class UpdatingEnv(ScriptedEnv):
        async def step(self, action_text: str) -> StepResult:
            if not self.actions:  # the trainer publishes version 1 while turn 0 is being judged
                client = EngineClient(engine.url)
                await client.begin_weight_update()  # sglang 0.5.23 refuses updates outside a session
                await client.update_weights_from_tensor(
                    [encode_safetensors_payload(new_weights)], load_format=SAFETENSORS_LOAD_FORMAT, weight_version="1"
                )
                await client.end_weight_update()
            return await super().step(action_text)

    loop = make_loop(engine.url, tokenizer, lambda s: UpdatingEnv(done_after=2), max_concurrent_trajectories=1)
    try:
        traj = asyncio.run(loop.run_trajectory(sample()))
    finally:
        asyncio.run(EngineClient(engine.url).update_weight_version("0"))
    assert traj.status == TrajectoryStatus.COMPLETED, traj.status_reason
    first, second = traj.turns
    assert set(traj.policy_versions[first.action_start : first.action_end]) == {0}
    assert set(traj.policy_versions[second.action_start : second.action_end]) == {1}
    assert traj.staleness(1) == [1] * first.num_action_tokens + [0] * second.num_action_tokens


def test_env_and_reward_failures_mark_the_trajectory_failed(engine, tokenizer):
    scripts = {
        "raise": ScriptedEnv(done_after=3, raise_at=0),
        "reward": ScriptedEnv(done_after=3, fail_info_at=0),
    }

    class BrokenReset(ScriptedEnv):
        async def reset(self, s):
            await asyncio.sleep(0)  # an awaited reset fails like a synchronous one did
            raise OSError("sandbox did not start")

    def factory(s):
        return scripts.get(s.prompt_id) or BrokenReset()

    loop = make_loop(engine.url, tokenizer, factory, max_new_tokens_per_turn=400)
    trajs = {t.prompt_id: t for t in asyncio.run(loop.run([sample("raise"), sample("reward"), sample("reset")]))}
    assert {t.status for t in trajs.values()} == {TrajectoryStatus.FAILED}
    assert trajs["raise"].status_reason.startswith("env_step_error: RuntimeError('scripted failure at turn 0')")
    assert trajs["reward"].status_reason == "reward_error: scripted reward failure"
    assert trajs["reset"].status_reason.startswith("env_reset_error: OSError")
    assert loop.stats.failure_reasons == {"env_step_error": 1, "reward_error": 1, "env_reset_error": 1}
    assert scripts["raise"].closed and scripts["reward"].closed


def test_reward_error_key_is_one_the_loop_reads():
    from megatron_sao.rollout.rewards.base import REWARD_ERROR_KEY

    assert REWARD_ERROR_KEY in FAILURE_INFO_KEYS


@pytest.mark.parametrize(
    "config, reason",
    [
        ({"max_turns": 1}, "max_turns"),
        ({"max_new_tokens_per_turn": 1}, "max_new_tokens_per_turn"),
        ({"max_total_tokens": 24}, "max_total_tokens"),
    ],
)
def test_limits_truncate_with_the_truncation_reward(engine, tokenizer, config, reason):
    loop = make_loop(engine.url, tokenizer, lambda s: ScriptedEnv(done_after=50), truncation_reward=-0.5, **config)
    trajs = asyncio.run(loop.run([sample(f"p{i}", "Hi") for i in range(4)]))
    truncated = [t for t in trajs if t.status_reason == reason]
    assert truncated, [t.status_reason for t in trajs]
    for traj in truncated:
        traj.validate()
        assert traj.status == TrajectoryStatus.TRUNCATED and traj.terminal_reward == -0.5
        assert len(traj) <= loop.config.max_total_tokens and len(traj.turns) <= loop.config.max_turns


def test_abort_ends_running_trajectories_as_aborted(engine, tokenizer):
    class SlowEnv(ScriptedEnv):
        async def step(self, action_text: str) -> StepResult:
            await asyncio.sleep(0.2)
            return await super().step(action_text)

    loop = make_loop(
        engine.url,
        tokenizer,
        lambda s: SlowEnv(done_after=100),
        max_new_tokens_per_turn=4000,
        max_turns=100,
        max_total_tokens=4000,
    )

    async def go():
        task = asyncio.create_task(loop.run([sample(f"p{i}") for i in range(6)]))
        await asyncio.sleep(1.0)
        await loop.abort()
        return await asyncio.wait_for(task, 30)

    trajs = asyncio.run(go())
    assert len(trajs) == 6 and {t.status for t in trajs} == {TrajectoryStatus.ABORTED}
    for traj in trajs:
        traj.validate()


def test_engine_side_abort_resumes_the_turn_exactly(engine, tokenizer, reference):
    """pause_generation(abort) + continue (a weight sync) in the middle of turns: the partial
    turns are kept and finished by a second call, and the record is still exact."""
    client = EngineClient(engine.url)
    loop = make_loop(engine.url, tokenizer, lambda s: ScriptedEnv(done_after=20), max_turns=20, max_total_tokens=2048)

    async def go():
        task = asyncio.create_task(loop.run([sample(f"p{i}") for i in range(8)]))
        for _ in range(3):
            while not task.done() and (await client.get_server_info())["internal_states"][0]["num_running_reqs"] < 2:
                await asyncio.sleep(0.005)
            await client.pause_generation(mode="abort")
            await asyncio.sleep(0.05)
            await client.continue_generation()
        return await asyncio.wait_for(task, 60)

    trajs = asyncio.run(go())
    assert sum(t.num_engine_retries for t in trajs) >= 1
    for traj in trajs:
        assert traj.status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED), traj.status_reason
        traj.validate()
        action_logprobs_match_the_model(reference, traj)


def test_non_integer_engine_versions_are_refused_clearly():
    assert parse_policy_version("12") == 12
    with pytest.raises(ValueError, match="--weight-version 0"):
        parse_policy_version("default")
