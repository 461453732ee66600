"""Trajectories -> micro-batches: token balance across data-parallel ranks, length buckets,
token budgets, equal micro-batch counts, Megatron's tensor conventions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sao.training.batches import (
    PackingConfig,
    balance_across_ranks,
    build_micro_batch,
    plan_micro_batches,
    shard_batch,
)
from tests.training.trajectories import random_trajectories


def _padded(plan, lengths, packing):
    return [sum(len(g) * packing.padded(max((lengths[i] for i in g), default=1)) for g in groups) for groups in plan]


def test_long_tail_loads_one_rank_not_all():
    lengths = [16 * 100] + [100] * 31  # one 16x-longer trajectory among 31 short ones
    packing = PackingConfig(micro_batch_size=4)
    plan = plan_micro_batches(lengths, 4, packing)
    padded = _padded(plan, lengths, packing)
    # Naive padding of everything to the longest: 32 x 1600 = 51,200 tokens; here ~5,000 in all.
    assert sum(padded) <= 1.05 * sum(lengths)
    long_rank = next(r for r, groups in enumerate(plan) if any(0 in g for g in groups))
    assert all(0 not in g for r, groups in enumerate(plan) if r != long_rank for g in groups)
    assert [g for g in plan[long_rank] if 0 in g] == [[0]]  # nobody is padded to it
    assert max(padded) == padded[long_rank] and min(padded) >= 1000


def test_token_budget_buckets_by_length():
    lengths = [10, 11, 12, 50, 52, 200]
    plan = plan_micro_batches(lengths, 1, PackingConfig(max_tokens_per_micro_batch=120))
    assert plan == [[[5], [4, 3], [2, 1, 0]]]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40), ranks=st.integers(1, 4),
       budget=st.one_of(st.none(), st.integers(16, 800)), mbs=st.integers(1, 5), multiple=st.sampled_from([1, 2, 4]))
def test_plan_properties(lengths, ranks, budget, mbs, multiple):
    packing = PackingConfig(micro_batch_size=mbs, max_tokens_per_micro_batch=budget, pad_to_multiple_of=multiple)
    plan = plan_micro_batches(lengths, ranks, packing)
    assert len(plan) == ranks and len({len(groups) for groups in plan}) == 1  # same count everywhere
    assigned = sorted(i for groups in plan for g in groups for i in g)
    assert assigned == list(range(len(lengths)))  # every trajectory exactly once
    for groups in plan:
        for g in groups:
            if len(g) > 1:  # a micro-batch over the budget only when it is a single trajectory
                assert packing.fits(len(g), max(lengths[i] for i in g))


def test_balance_is_deterministic_and_greedy():
    assert balance_across_ranks([5, 9, 1, 9], 2) == [[1, 0], [3, 2]]
    with pytest.raises(ValueError):
        balance_across_ranks([1], 0)


def test_micro_batch_in_megatron_conventions():
    trajectories = random_trajectories(3, seed=4)
    mb = build_micro_batch(trajectories, PackingConfig(pad_to_multiple_of=8))
    b, t = mb["input_ids"].shape
    assert b == 3 and t % 8 == 0 and t >= max(len(x) for x in trajectories)
    assert "attention_mask" not in mb  # causal by the layers' mask type: no [t, t] tensor
    assert torch.equal(mb["labels"][:, :-1], mb["input_ids"][:, 1:])
    for row, traj in enumerate(trajectories):
        n = len(traj)
        assert mb["loss_mask"][row, :n].tolist() == [bool(x) for x in traj.loss_mask]
        assert not mb["loss_mask"][row, n:].any() and not mb["token_mask"][row, n:].any()
        assert float(mb["rewards"][row].sum()) == pytest.approx(traj.total_reward)
    empty = build_micro_batch([], PackingConfig(pad_to_multiple_of=2))
    assert empty["input_ids"].shape == (1, 2) and not empty["loss_mask"].any()


def test_shard_batch_counts_global_tokens():
    trajectories = random_trajectories(7, seed=6, long_every=7)
    shards = [shard_batch(trajectories, r, 2, PackingConfig(micro_batch_size=2)) for r in range(2)]
    assert shards[0].global_action_tokens == sum(t.num_action_tokens for t in trajectories)
    rows = sorted(i for s in shards for group in s.trajectory_indices for i in group)
    assert rows == list(range(7))
    assert len(shards[0].micro_batches) == len(shards[1].micro_batches)
    with pytest.raises(ValueError, match="at least one trajectory"):
        shard_batch([], 0, 1, PackingConfig())


def test_model_batch_aligns_loss_inputs_to_the_position_that_predicts_them():
    """Position t predicts labels[t] = token t + 1; its mask, rollout log-prob and targets are that
    token's (training/context_parallel.py), and `token_positions` undoes the shift."""
    from megatron_sao.training.context_parallel import model_batch, token_positions

    trajectories = random_trajectories(3, seed=6)
    mb = build_micro_batch(trajectories, PackingConfig(pad_to_multiple_of=4))
    mb["advantages"] = torch.randn(mb["loss_mask"].shape)
    local = model_batch(mb)  # CP = 1: the whole sequence
    assert torch.equal(local["labels"][:, :-1], mb["input_ids"][:, 1:])
    for key in ("loss_mask", "rollout_logprobs", "advantages"):
        assert torch.equal(local[f"label_{key}"][:, :-1], mb[key][:, 1:]), key
        assert not local[f"label_{key}"][:, -1].any(), key  # the last position predicts nothing
        assert torch.equal(token_positions(local[f"label_{key}"]), torch.where(
            torch.arange(mb[key].shape[1]) > 0, mb[key], torch.zeros_like(mb[key]))), key
    assert torch.equal(local["token_mask"], mb["token_mask"])  # input-aligned (router load counts)
    assert "returns" not in mb and "label_returns" not in local


@pytest.mark.parametrize(("overrides", "multiple"), [
    ([], 1), (["parallelism.context=2"], 4), (["parallelism.tensor=2", "parallelism.context=2"], 8),
])
def test_one_packing_rule_for_every_critic_forward(overrides, multiple):
    """Train steps and value pretraining's held-out evaluation pack the critic by one rule, the
    context-parallel term included (value pretraining had its own rule without it: 1 and 2 here)."""
    from megatron_sao.config import load_config
    from megatron_sao.training.trainer import role_packing

    config = load_config(None, [*overrides, "launcher.nproc_per_node=4", "critic.max_tokens_per_micro_batch=64"])
    packing = role_packing(config, "critic")
    assert packing.pad_to_multiple_of == multiple
    assert packing.max_tokens_per_micro_batch == 64
