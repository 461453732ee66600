"""Ablation baselines: GRPO advantages, running-mean baselines, step-level advantages."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.algo import (
    RunningMeanBaseline,
    broadcast_to_tokens,
    grpo_advantages,
    skip_observation_gae,
    step_level_advantages,
)
from tests.algo.helpers import textbook_gae, turn_mask

# ---- GRPO -------------------------------------------------------------------------------------


def test_grpo_normalises_within_each_group_and_broadcasts_to_action_tokens() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    group_ids = torch.tensor([7, 7, 7, 3, 3, 3])
    mask = turn_mask([[2, 1, 1]] * 6, num_tokens=5)
    adv = grpo_advantages(rewards, group_ids, mask)
    per_traj = torch.cat([(g - g.mean()) / (g.std() + 1e-6) for g in (rewards[:3], rewards[3:])])
    torch.testing.assert_close(adv, torch.where(mask, per_traj[:, None], 0.0), rtol=1e-12, atol=1e-12)


def test_grpo_groups_need_not_be_contiguous() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0])
    mask = torch.ones(4, 3, dtype=torch.bool)
    interleaved = grpo_advantages(rewards, torch.tensor([0, 1, 0, 1]), mask)
    contiguous = grpo_advantages(rewards[[0, 2, 1, 3]], torch.tensor([0, 0, 1, 1]), mask)
    torch.testing.assert_close(interleaved[[0, 2, 1, 3]], contiguous)


def test_grpo_mean_only_equal_rewards_and_singleton_groups() -> None:
    mask = torch.ones(5, 2, dtype=torch.bool)
    rewards = torch.tensor([1.0, 3.0, 0.5, 0.5, 4.0])
    ids = torch.tensor([0, 0, 1, 1, 2])
    mean_only = grpo_advantages(rewards, ids, mask, normalize_std=False)
    assert mean_only[:, 0].tolist() == [-1.0, 1.0, 0.0, 0.0, 0.0]
    normalised = grpo_advantages(rewards, ids, mask)
    assert normalised[2:, 0].tolist() == [0.0, 0.0, 0.0]  # equal rewards and a group of one: 0


def test_grpo_rejects_bad_arguments() -> None:
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(2), torch.zeros(2), mask)
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), mask)


def test_broadcast_to_tokens() -> None:
    mask = torch.tensor([[True, False, True], [False, False, False]])
    assert broadcast_to_tokens(torch.tensor([2.0, 5.0]), mask).tolist() == [[2.0, 0.0, 2.0], [0.0, 0.0, 0.0]]


# ---- running mean -----------------------------------------------------------------------------


def test_per_prompt_running_mean_uses_the_last_window_rewards_before_the_batch() -> None:
    baseline = RunningMeanBaseline(window=2, scope="prompt", initial=0.5)
    first = baseline.advantages(torch.tensor([1.0, 0.0]), ["a", "b"])
    assert first.tolist() == [0.5, -0.5]  # empty windows: the initial baseline
    second = baseline.advantages(torch.tensor([0.0, 1.0, 1.0]), ["a", "a", "c"])
    assert second.tolist() == [-1.0, 0.0, 0.5]  # both "a" rows scored against [1.0]
    third = baseline.advantages(torch.tensor([1.0]), ["a"])
    assert third.tolist() == [0.5]  # the window of 2 holds "a"'s [0.0, 1.0]: 1.0 was pushed out
    assert baseline.baseline("a") == pytest.approx(1.0)  # now [1.0, 1.0]


def test_global_running_mean_ignores_prompt_ids() -> None:
    baseline = RunningMeanBaseline(window=3, scope="global")
    baseline.advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert baseline.baseline("anything") == pytest.approx(3.0)  # last three: 2, 3, 4
    assert baseline.advantages(torch.tensor([5.0]), ["x"]).tolist() == [2.0]


def test_running_mean_state_round_trip() -> None:
    baseline = RunningMeanBaseline(window=4, scope="prompt")
    baseline.advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([10, 11, 10]))
    restored = RunningMeanBaseline(window=4, scope="prompt")
    restored.load_state_dict(baseline.state_dict())
    batch = torch.tensor([0.25, 0.75])
    assert restored.advantages(batch, [10, 11]).tolist() == baseline.advantages(batch, [10, 11]).tolist()
    with pytest.raises(ValueError, match="window"):
        RunningMeanBaseline(window=8, scope="prompt").load_state_dict(baseline.state_dict())


def test_running_mean_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="window"):
        RunningMeanBaseline(window=0)
    with pytest.raises(ValueError, match="scope"):
        RunningMeanBaseline(window=2, scope="group")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt_ids"):
        RunningMeanBaseline(window=2).advantages(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="prompt_ids"):
        RunningMeanBaseline(window=2).advantages(torch.tensor([1.0, 2.0]), ["a"])


# ---- step level -------------------------------------------------------------------------------


def _two_turn_row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # prompt 1, turn A (3 tokens), observation 2 with a reward, turn B (2 tokens), padding 2.
    mask = turn_mask([[3, 2, 2]], num_tokens=10, prompt=1)
    values = torch.tensor([[9.0, 0.1, 0.2, 0.6, 9.0, 9.0, 0.4, 0.8, 9.0, 9.0]], dtype=torch.float64)
    rewards = torch.zeros(1, 10, dtype=torch.float64)
    rewards[0, 5] = 0.25  # on the observation: credited to turn A
    rewards[0, 9] = 1.0  # on padding: credited to turn B
    return rewards, values, mask


@pytest.mark.parametrize(("mode", "turn_values"), [("average", [0.3, 0.6]), ("last", [0.6, 0.8])])
def test_step_level_runs_gae_over_turns_and_broadcasts(mode: str, turn_values: list[float]) -> None:
    rewards, values, mask = _two_turn_row()
    adv, ret = step_level_advantages(rewards, values, mask, gamma=0.9, lam=0.7, mode=mode)
    turn_adv = textbook_gae([0.25, 1.0], turn_values, gamma=0.9, lam=0.7)
    expected_adv = torch.tensor([[0, *[turn_adv[0]] * 3, 0, 0, *[turn_adv[1]] * 2, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected_adv, rtol=1e-12, atol=1e-12)
    expected_ret = torch.tensor([[0, *[turn_adv[0] + turn_values[0]] * 3, 0, 0, *[turn_adv[1] + turn_values[1]] * 2,
                                  0, 0]], dtype=torch.float64)
    torch.testing.assert_close(ret, expected_ret, rtol=1e-12, atol=1e-12)


def test_step_level_with_one_token_turns_equals_token_level_gae() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = turn_mask([[1, 2, 1, 1, 1, 3, 1], [1, 1, 1]], num_tokens=12)
    rewards = torch.randn(2, 12, generator=gen, dtype=torch.float64)
    values = torch.randn(2, 12, generator=gen, dtype=torch.float64)
    lam = torch.tensor([0.5, 0.9], dtype=torch.float64)
    for mode in ("average", "last"):
        got = step_level_advantages(rewards, values, mask, gamma=0.95, lam=lam, mode=mode)
        want = skip_observation_gae(rewards, values, mask, gamma=0.95, lam=lam)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_step_level_turn_ids_split_back_to_back_action_spans() -> None:
    mask = torch.ones(1, 4, dtype=torch.bool)
    values = torch.tensor([[1.0, 3.0, 5.0, 7.0]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    merged, _ = step_level_advantages(rewards, values, mask, lam=0.0)
    split, _ = step_level_advantages(rewards, values, mask, lam=0.0, turn_ids=torch.tensor([[0, 0, 1, 1]]))
    assert merged[0].tolist() == [1.0 - 4.0] * 4
    assert split[0].tolist() == [6.0 - 2.0, 6.0 - 2.0, 1.0 - 6.0, 1.0 - 6.0]


def test_step_level_empty_rows_and_float32() -> None:
    rewards, values, mask = _two_turn_row()
    mask = torch.cat([mask, torch.zeros_like(mask)])
    adv, ret = step_level_advantages(torch.cat([rewards, rewards]).float(), torch.cat([values, values]).float(), mask)
    assert adv.dtype == torch.float32 and not adv[1].any() and not ret[1].any()
    none, _ = step_level_advantages(rewards, values, torch.zeros_like(mask[:1]))
    assert not none.any()


def test_step_level_rejects_bad_mode() -> None:
    rewards, values, mask = _two_turn_row()
    with pytest.raises(ValueError, match="mode"):
        step_level_advantages(rewards, values, mask, mode="first")  # type: ignore[arg-type]
