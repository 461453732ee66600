"""The trajectory record: building keeps exact per-token invariants; validate() catches broken
records; collate_trajectories() puts every value at the right [b, t]."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sao.rollout.trajectory import NO_POLICY_VERSION, FinishType, RewardKind, Trajectory
from megatron_sao.rollout.trajectory_batch import collate_trajectories
from tests.rollout.trajectory_strategies import trajectories, two_turn


@settings(max_examples=60, deadline=None)
@given(trajectories())
def test_built_trajectory_has_exact_masks_versions_and_turns(case):
    traj, truth = case
    traj.validate()
    assert traj.loss_mask == truth["mask"]
    assert traj.policy_versions == truth["versions"]
    assert traj.rollout_logprobs == truth["logprobs"]
    assert len(traj.turns) == truth["num_turns"]
    for turn in traj.turns:  # turn spans agree with the mask
        assert all(traj.loss_mask[t] == 1 for t in range(turn.action_start, turn.action_end))
        assert all(traj.loss_mask[t] == 0 for t in range(turn.action_end, turn.observation_end))
    for reward in traj.rewards:  # credited to the last token of its action span
        assert traj.loss_mask[reward.position] == 1
        assert reward.position + 1 == len(traj) or traj.loss_mask[reward.position + 1] == 0
    assert traj.rewards[-1].position == max(t for t, m in enumerate(traj.loss_mask) if m)
    assert traj.num_action_tokens == sum(truth["mask"])
    assert traj.staleness(10) == [10 - v for v, m in zip(truth["versions"], truth["mask"], strict=True) if m]


@settings(max_examples=30, deadline=None)
@given(st.lists(trajectories(), min_size=1, max_size=4), st.integers(1, 8))
def test_collate_places_every_value_at_its_token(cases, multiple):
    trajs = [c[0] for c in cases]
    batch = collate_trajectories(trajs, pad_token_id=7, pad_to_multiple_of=multiple)
    B, T = batch.token_ids.shape
    assert (B, T % multiple) == (len(trajs), 0)
    assert max(len(t) for t in trajs) <= T
    for b, traj in enumerate(trajs):
        n = len(traj)
        assert batch.token_ids[b, :n].tolist() == traj.token_ids
        assert (batch.token_ids[b, n:] == 7).all()
        assert batch.attention_mask[b].tolist() == [True] * n + [False] * (T - n)
        assert batch.loss_mask[b, :n].tolist() == [bool(m) for m in traj.loss_mask]
        assert not batch.loss_mask[b, n:].any()
        assert batch.policy_versions[b, :n].tolist() == traj.policy_versions
        assert (batch.policy_versions[b, n:] == NO_POLICY_VERSION).all()
        expected_lp = torch.tensor(traj.rollout_logprobs, dtype=torch.float32)
        assert torch.equal(batch.rollout_logprobs[b, :n], expected_lp)
        rewards = torch.zeros(T, dtype=torch.float64)
        for r in traj.rewards:
            rewards[r.position] += r.value
        assert torch.allclose(batch.rewards[b].double(), rewards, atol=1e-6)
        assert batch.lengths[b] == n and batch.prompt_lengths[b] == traj.prompt_length
    assert batch.loss_mask.dtype == torch.bool and batch.rollout_logprobs.dtype == torch.float32


def test_two_turn_layout_is_exact():
    traj = two_turn()
    assert traj.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert traj.loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert traj.policy_versions == [-1, -1, -1, 0, 0, -1, 1]
    assert [(t.action_start, t.action_end, t.observation_end) for t in traj.turns] == [(3, 5, 6), (6, 7, 7)]
    assert traj.rewards[0].position == 6 and traj.terminal_reward == 1.0


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda t: t.loss_mask.__setitem__(5, 1), "loss_mask"),
        (lambda t: t.policy_versions.__setitem__(4, -1), "policy version"),
        (lambda t: t.policy_versions.__setitem__(5, 3), "non-action token"),
        (lambda t: t.rollout_logprobs.__setitem__(3, 0.5), "log-prob"),
        (lambda t: t.rollout_logprobs.pop(), "rollout_logprobs"),
        (lambda t: setattr(t.rewards[0], "position", 5), "last token"),
        (lambda t: setattr(t.turns[1], "action_start", 5), "starts at"),
        (lambda t: t.add_reward(2.0, RewardKind.TERMINAL), "terminal rewards"),
        (lambda t: setattr(t.rewards[0], "value", float("nan")), "not finite"),
        (lambda t: setattr(t.rewards[0], "value", float("-inf")), "not finite"),
    ],
)
def test_validate_names_the_broken_invariant(corrupt, message):
    traj = two_turn()
    corrupt(traj)
    with pytest.raises(ValueError, match=message):
        traj.validate()


def test_building_refuses_misuse():
    traj = Trajectory(prompt_id="p")
    with pytest.raises(ValueError, match="before set_prompt"):
        traj.append_action([1], [-1.0], [0], FinishType.STOP)
    traj.set_prompt([1])
    with pytest.raises(ValueError, match="follow an action"):
        traj.append_observation([2])
    with pytest.raises(ValueError, match="at least one action"):
        traj.add_reward(1.0, RewardKind.TERMINAL)
    with pytest.raises(ValueError, match="differ in length"):
        traj.append_action([1, 2], [-1.0], [0, 0], FinishType.STOP)
    with pytest.raises(ValueError, match=">= 0"):
        traj.append_action([1], [-1.0], [-1], FinishType.STOP)


def test_collate_refuses_empty_and_too_long():
    with pytest.raises(ValueError, match="at least one"):
        collate_trajectories([])
    with pytest.raises(ValueError, match="max_length"):
        collate_trajectories([two_turn()], max_length=3)
