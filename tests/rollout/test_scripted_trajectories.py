"""Scripted-policy trajectories: valid records, deterministic, long-tailed lengths, a reward the
difficulty tag predicts, and rollout log-probs equal to the checkpoint's own model."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from megatron_sao.rollout.scripted_trajectories import ScriptedTaskConfig, make_scripted_trajectories
from megatron_sao.rollout.trajectory import RewardKind, Trajectory, TrajectoryStatus
from megatron_sao.rollout.trajectory_io import trajectory_to_dict

NUM = 200


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint

    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)


@pytest.fixture(scope="module")
def trajectories(hf_dir: Path) -> list[Trajectory]:
    return make_scripted_trajectories(hf_dir, NUM, seed=3)


def test_records_are_valid_finished_multi_turn_episodes(trajectories: list[Trajectory]) -> None:
    assert len(trajectories) == NUM
    for traj in trajectories:
        traj.validate()
        assert 1 <= len(traj.turns) <= 4
        assert traj.turns[-1].num_observation_tokens == 0  # ends with an action
        assert all(t.num_observation_tokens > 0 for t in traj.turns[:-1])  # tool output between actions
        assert set(traj.action_versions()) == {0}
        assert traj.terminal_reward in (0.0, 1.0)
        assert traj.terminal_reward == float(traj.metadata["success"])
    statuses = {traj.status for traj in trajectories}
    assert statuses == {TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED}
    assert {len(traj.turns) for traj in trajectories} == {1, 2, 3, 4}
    assert len({traj.prompt_id for traj in trajectories}) == NUM
    assert len({traj.trajectory_id for traj in trajectories}) == NUM


def test_truncated_trajectories_used_every_turn_and_failed(trajectories: list[Trajectory]) -> None:
    truncated = [t for t in trajectories if t.status == TrajectoryStatus.TRUNCATED]
    assert len(truncated) >= 5
    for traj in truncated:
        assert len(traj.turns) == 4 and traj.status_reason == "max_turns" and traj.terminal_reward == 0.0


def test_same_arguments_give_bit_identical_records(hf_dir: Path) -> None:
    first, second = (make_scripted_trajectories(hf_dir, 24, seed=3) for _ in range(2))
    assert [trajectory_to_dict(t) for t in first] == [trajectory_to_dict(t) for t in second]
    other = make_scripted_trajectories(hf_dir, 24, seed=4)
    assert [t.token_ids for t in other] != [t.token_ids for t in first]


def test_a_shorter_run_is_a_prefix_of_a_longer_one(hf_dir: Path, trajectories: list[Trajectory]) -> None:
    """Episodes are drawn one after another; only the log-probs' last bits may differ, because the
    scoring batches are composed differently (float32 sums in another order)."""
    short = make_scripted_trajectories(hf_dir, 20, seed=3)
    for a, b in zip(short, trajectories[:20], strict=False):
        da, db = trajectory_to_dict(a), trajectory_to_dict(b)
        assert {k: v for k, v in da.items() if k != "rollout_logprobs"} == {
            k: v for k, v in db.items() if k != "rollout_logprobs"
        }
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs, strict=True)) <= 1e-5


def test_lengths_vary_with_a_long_tail(trajectories: list[Trajectory]) -> None:
    lengths = sorted(len(t) for t in trajectories)
    median = statistics.median(lengths)
    assert lengths[0] <= 40
    assert 50 <= median <= 150
    assert lengths[-1] >= 4 * median
    assert 2 <= sum(n >= 3 * median for n in lengths) <= NUM // 10  # a few, not many


def test_reward_is_predictable_from_the_visible_difficulty_tag(hf_dir: Path, trajectories: list[Trajectory]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    by_tag: dict[str, list[float]] = {"easy": [], "hard": []}
    for traj in trajectories:
        prompt = tokenizer.decode(traj.token_ids[: traj.prompt_length])
        tag = "easy" if "easy:" in prompt else "hard"
        assert f"{traj.metadata['difficulty']}:" in prompt
        by_tag[tag].append(traj.terminal_reward)
    assert min(len(v) for v in by_tag.values()) >= NUM // 4
    rate = {tag: sum(v) / len(v) for tag, v in by_tag.items()}
    assert rate["easy"] >= 0.85 and rate["hard"] <= 0.15, rate
    # A value function that reads only the tag explains more than half of the return variance.
    returns = [r for v in by_tag.values() for r in v]
    residual = sum((r - rate[tag]) ** 2 for tag, v in by_tag.items() for r in v)
    assert 1 - residual / (len(returns) * statistics.pvariance(returns)) > 0.5


def test_rollout_logprobs_are_the_models_own(hf_dir: Path, trajectories: list[Trajectory]) -> None:
    """Batched, padded scoring equals one unpadded forward per trajectory (<= 1e-5), for the
    shortest, the longest and a few in between."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    order = sorted(range(NUM), key=lambda i: len(trajectories[i]))
    for i in (order[0], order[NUM // 3], order[NUM // 2], order[-2], order[-1]):
        traj = trajectories[i]
        ids = torch.tensor([traj.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float()[0], dim=-1)
        expected = torch.zeros(len(traj))
        expected[1:] = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        got = torch.tensor(traj.rollout_logprobs, dtype=torch.float32)
        assert torch.allclose(got[mask], expected[mask], atol=1e-5, rtol=0), (got[mask] - expected[mask]).abs().max()
        assert (got[~mask] == 0).all()


def test_group_size_gives_contiguous_groups_of_one_prompt(hf_dir: Path) -> None:
    groups = make_scripted_trajectories(hf_dir, 12, seed=5, group_size=4)
    for g in range(3):
        group = groups[4 * g : 4 * g + 4]
        assert len({t.prompt_id for t in group}) == 1
        assert len({tuple(t.token_ids[: t.prompt_length]) for t in group}) == 1
        assert len({t.trajectory_id for t in group}) == 4
    assert len({t.prompt_id for t in groups}) == 3
    with pytest.raises(ValueError, match="multiple of group_size"):
        make_scripted_trajectories(hf_dir, 10, seed=5, group_size=4)


def test_optional_turn_reward_lands_on_calculator_calls(hf_dir: Path) -> None:
    task = ScriptedTaskConfig(turn_reward=0.1)
    for traj in make_scripted_trajectories(hf_dir, 30, seed=6, task=task):
        traj.validate()
        turn_rewards = [r for r in traj.rewards if r.kind == RewardKind.TURN]
        calls = len(traj.turns) - (traj.status == TrajectoryStatus.COMPLETED)
        assert [r.turn for r in turn_rewards] == list(range(calls))
        assert all(r.value == 0.1 for r in turn_rewards)


def test_bad_task_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="easy_success"):
        ScriptedTaskConfig(easy_success=1.5)
    with pytest.raises(ValueError, match="turn_weights"):
        ScriptedTaskConfig(turn_weights=(1.0,))
