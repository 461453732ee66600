"""Property tests of the agent loop's bookkeeping against a scripted engine: for random episodes
(turn counts, action lengths, engine-side aborts, weight updates landing mid-answer, turn and
token limits) the trajectory holds exactly the engine's tokens with loss_mask 1, their log-probs
and per-token versions, the template's observation tokens with loss_mask 0, rewards on the
right tokens, and the status the limits imply."""

from __future__ import annotations

import asyncio

from hypothesis import event, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.trajectory import RewardKind, TrajectoryStatus
from tests.rollout.engine_helpers import IM_END, Answer, ScriptedEngine, ScriptedEnv, sample, tiny_checkpoint

TOKENIZER = AutoTokenizer.from_pretrained(tiny_checkpoint())


plain_tokens = st.lists(st.integers(0, 255), min_size=1, max_size=7)


@st.composite
def episodes(draw):
    done_after = draw(st.integers(1, 4))
    answers = []
    for _ in range(done_after + 2):  # spare answers for scripts the limits cut short
        for _ in range(draw(st.integers(0, 2))):  # engine-side aborts, with partial output
            answers.append(Answer(draw(st.lists(st.integers(0, 255), max_size=4)), "abort", None))
        tokens = [*draw(plain_tokens), IM_END]
        answers.append(Answer(tokens, "stop", draw(st.none() | st.integers(0, len(tokens) - 1))))
    env = ScriptedEnv(
        done_after=done_after,
        terminal_reward=draw(st.floats(-1, 1)),
        turn_rewards=draw(st.lists(st.sampled_from([0.0, 0.5, -0.25]), min_size=4, max_size=4)),
        observations=draw(st.lists(st.text("abcxyz 0123\n", max_size=12), min_size=4, max_size=4)),
    )
    config = AgentLoopConfig(
        max_turns=draw(st.integers(1, 5)),
        max_new_tokens_per_turn=draw(st.integers(1, 12) | st.just(64)),
        max_total_tokens=28 if draw(st.integers(0, 9)) == 0 else draw(st.integers(29, 120)),  # prompt: 28
        max_engine_retries=100,
    )
    return answers, env, config


def _observation_tokens(text: str) -> list[int]:
    """The tiny chat template's rendering of a tool message after a closed assistant turn,
    written out by hand (independent of ChatFormat)."""
    return TOKENIZER.encode(f"\n<|im_start|>tool\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


@settings(max_examples=150, deadline=None)
@given(episodes())
def test_trajectory_records_exactly_what_engine_and_environment_produced(episode):
    answers, env, config = episode
    engine = ScriptedEngine(answers=list(answers))
    loop = AgentLoop(config, TOKENIZER, EnginePool([engine]), lambda s: env)
    traj = asyncio.run(loop.run_trajectory(sample("p", "Solve it.")))
    traj.validate()
    assert env.closed
    event(f"{traj.status}: {traj.status_reason}, retries={min(traj.num_engine_retries, 2)}")

    prompt = TOKENIZER.encode(
        "<|im_start|>user\nSolve it.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    if len(prompt) >= config.max_total_tokens:
        assert traj.status == TrajectoryStatus.FAILED and traj.status_reason.startswith("prompt_too_long")
        assert not engine.calls and len(traj) == len(prompt)
        return
    expected_ids = list(prompt)
    expected_mask, expected_lp, expected_ver = [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt)
    closed_turns = 0
    for k, (input_ids, limit, tokens, logprobs, versions, _) in enumerate(engine.calls):
        assert input_ids == expected_ids, "token-in: every call sees exactly the trajectory so far"
        assert limit <= config.max_new_tokens_per_turn and len(input_ids) + limit <= config.max_total_tokens
        expected_ids += tokens
        expected_mask += [1] * len(tokens)
        expected_lp += logprobs
        expected_ver += versions
        if tokens and tokens[-1] == IM_END:
            closed_turns += 1
            if k < len(engine.calls) - 1:  # the loop went on: the observation was appended
                obs = _observation_tokens(env.observations[closed_turns - 1])
                expected_ids += obs
                expected_mask += [0] * len(obs)
                expected_lp += [0.0] * len(obs)
                expected_ver += [-1] * len(obs)
    assert traj.token_ids == expected_ids
    assert traj.loss_mask == expected_mask
    assert traj.rollout_logprobs == expected_lp
    assert traj.policy_versions == expected_ver

    # status and rewards follow from the script and the limits
    last_action_token = max(t for t, m in enumerate(traj.loss_mask) if m)
    if traj.status == TrajectoryStatus.COMPLETED:
        assert len(env.actions) == env.done_after == len(traj.turns)
        assert traj.terminal_reward == env.terminal_reward
    else:
        assert traj.status == TrajectoryStatus.TRUNCATED, traj.status_reason
        assert traj.terminal_reward == 0.0  # truncation_reward
        if traj.status_reason == "max_turns":
            assert len(traj.turns) == config.max_turns
        elif traj.status_reason == "max_new_tokens_per_turn":
            assert traj.turns[-1].num_action_tokens == config.max_new_tokens_per_turn
        else:
            assert traj.status_reason == "max_total_tokens"
            closed = traj.token_ids[-1] == IM_END
            assert len(traj) == config.max_total_tokens or (
                closed
                and len(traj) + len(_observation_tokens(env.observations[len(traj.turns) - 1]))
                >= config.max_total_tokens
            )
    terminal = [r for r in traj.rewards if r.kind == RewardKind.TERMINAL]
    assert len(terminal) == 1 and terminal[0].position == last_action_token
    for reward in traj.rewards:
        if reward.kind == RewardKind.TURN:
            assert reward.value == env.turn_rewards[reward.turn] != 0.0
            assert reward.position == traj.turns[reward.turn].action_end - 1
    assert traj.num_engine_retries == sum(1 for c in engine.calls if c[5] == "abort")
    assert len(env.actions) == closed_turns
