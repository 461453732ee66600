"""What one train step does: K critic updates, critic warmup, frozen critic attention, skipped
steps on NaN, every ablation, SFT (gloo, CPU, tiny Qwen3-MoE, fp32). The one-rank jobs run in the
one process of the `single_rank` fixture (tests/conftest.py)."""

from __future__ import annotations

import math

import pytest

from megatron_sao.platform import run_distributed
from tests.training import trainer_worker
from tests.training.trainer_worker import ABLATIONS


def test_k_critic_updates_warmup_and_frozen_attention(single_rank):
    r = single_rank["warmup_and_frozen"]
    history = r["history"]
    # K = 2: exactly two critic optimizer steps per train step, counted cumulatively.
    assert [m["critic/optimizer_steps"] for m in history] == [2, 4, 6, 8, 10]
    assert r["critic_schedule_steps"] == 10
    assert r["critic_decay_steps"] == 5 * 2  # the critic's schedule counts its own steps
    # Warmup 2: the actor is bit-identical after steps 1-2 and trains from step 3.
    assert r["actor_unchanged"] == [True, True, False, False, False]
    assert ["actor/loss" in m for m in history] == [False, False, True, True, True]
    assert r["actor_schedule_steps"] == 3
    assert r["state"]["trainer"]["actor_version"] == 3
    # Frozen critic attention: bit-identical after 5 steps; the rest of the critic trains.
    assert r["num_attention"] > 0 and r["critic_attention_unchanged"] and r["critic_other_changed"]
    assert all(m["critic/grad_norm/attention"] == 0.0 for m in history)


def test_explained_variance_is_nan_for_a_constant_return_batch(single_rank):
    """Every return 1.0: no EV (NaN, counted), the step still trains; the next batch, with spread
    returns, is reported and the count stays."""
    flat, spread = single_rank["constant_return"]
    assert math.isnan(flat["critic/explained_variance"]) and flat["critic/return_var"] == pytest.approx(0.0, abs=1e-9)
    assert flat["critic/explained_variance_nan_steps"] == 1.0
    assert math.isfinite(flat["actor/loss"]) and flat["train/step_skipped"] == 0.0
    assert math.isfinite(spread["critic/explained_variance"]) and spread["critic/return_var"] > 1e-3
    assert spread["critic/explained_variance_nan_steps"] == 1.0
    # The length-adaptive policy lambda (< 1) mixes the critic's later values into the advantage.
    assert spread["critic/advantage_bootstrap_std"] > 0 and -1 <= spread["critic/advantage_outcome_corr"] <= 1


# The critic variant (NaN values, hence NaN advantages: the whole step skipped) is slow.
@pytest.mark.parametrize("role", ["actor", pytest.param("critic", marks=pytest.mark.slow)])
def test_nan_on_one_rank_skips_the_step_everywhere(request, role):
    if role == "actor":  # computed in the `two_ranks` process pair (tests/conftest.py)
        ranks = [r["nan_actor"] for r in request.getfixturevalue("two_ranks")]
    else:
        ranks = run_distributed(trainer_worker.inject_nan, 2, str(request.getfixturevalue("tiny_hf_dir")), role, 1)
    for r in ranks:  # every rank: nothing of the poisoned role changed, not even optimizer state
        assert r["unchanged"][role], r["unchanged"]
        if role == "critic":  # NaN values -> NaN advantages: the whole step is skipped
            assert r["unchanged"]["actor"]
        assert r["first"]["train/step_skipped"] == 1.0 and r["first"]["train/skipped_steps"] == 1.0
        assert "actor/loss" not in r["first"]
        assert r["second"]["train/step_skipped"] == 0.0 and math.isfinite(r["second"]["actor/loss"])
        assert r["second"]["train/actor_version"] == 1.0
        assert "2 consecutive steps skipped" in r["aborted"]


def test_every_ablation_takes_a_step(single_rank):
    results = single_rank["ablations"]
    assert set(results) == set(ABLATIONS)
    for name, r in results.items():
        m = r["metrics"]
        assert r["actor_changed"] and math.isfinite(m["actor/loss"]) and m["actor/grad_norm"] > 0, name
        assert m["train/step_skipped"] == 0.0, name
    for name in ("grpo", "grpo_dis", "grpo_rollout_old_logprobs", "running_mean"):
        assert not results[name]["has_critic"] and "critic/value_loss" not in results[name]["metrics"], name
    for name in ("sao_k1", "full_parameter_critic", "step_level", "step_level_last", "mini_batches"):
        assert results[name]["has_critic"], name
    assert results["sao_k1"]["metrics"]["critic/optimizer_steps"] == 1
    assert results["full_parameter_critic"]["metrics"]["critic/grad_norm/attention"] > 0
    assert results["grpo"]["metrics"]["actor/clip_frac"] >= 0.0
    assert "actor/dis_masked_low_frac" in results["grpo_dis"]["metrics"]
    assert results["mini_batches"]["actor_optimizer_steps"] == 2
    baseline = results["running_mean"]["state"]["baseline"]
    assert baseline is not None and sum(len(h) for h in baseline["history"].values()) == 8


def test_sft_lowers_its_loss(single_rank):
    losses = single_rank["sft"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.slow  # the default suite trains in critic-only mode through tests/valuepretrain/test_train.py
def test_critic_only_mode_for_value_pretraining(tiny_hf_dir):
    r = run_distributed(trainer_worker.critic_only_steps, 1, str(tiny_hf_dir))[0]
    assert r["roles"] == ["critic"] and not r["has_actor"]
    losses = [m["critic/value_loss"] for m in r["history"]]
    assert [m["critic/optimizer_steps"] for m in r["history"]] == [1, 2, 3, 4]
    assert losses[-1] < losses[0] and all("actor/loss" not in m for m in r["history"])
