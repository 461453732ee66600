"""`sao train` with `rollout.source=engine`: a real CPU engine rolls out the calc task while the
trainer trains on what it finishes, and each new actor version goes back into the engine."""

from __future__ import annotations

import json

import pytest

from megatron_sao.config import load_config
from megatron_sao.jobs.train import run_train
from megatron_sao.rollout.envs.calc import write_calc_dataset


def _engine_config(tmp_path, hf_dir, name: str, *overrides: str):
    prompts = write_calc_dataset(tmp_path / "calc.jsonl", 64, seed=0)
    return load_config(None, [
        f"run.output_dir={tmp_path}", f"run.name={name}", f"model.hf_path={hf_dir}", "model.dtype=float32",
        "launcher.nproc_per_node=1", "logging.param_table=false", "logging.wandb_mode=disabled",
        "rollout.source=engine", "rollout.engine=cpu", "rollout.num_engines=1", "rollout.environment=calc",
        "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=12", "rollout.max_total_tokens=320",
        "rollout.max_inflight_per_engine=8", f"data.train_path={prompts}", "data.batch_size=4",
        "critic.warmup_steps=1", "actor.optim.lr=1e-4", "critic.optim.lr=1e-4", "checkpoint.save_every=2",
        *overrides])


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Slow (default-suite time, issue 28): engine training: test_ray_placement short run; sync: test_weight_sync.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_engine_rollout_trains_and_syncs_weights(tmp_path, tiny_hf_dir):
    code, result, run_dir = run_train(_engine_config(tmp_path, tiny_hf_dir, "engine", "run.total_steps=3"))
    assert code == 0 and result["step"] == 3
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # nothing is lost: every started prompt is accounted for at every step
        assert r["rollout/started"] == (r["rollout/completed"] + r["rollout/aborted"] + r["rollout/failed"]
                                        + r["rollout/in_flight"])
        assert r["train/trajectories"] == 4
    assert rows[-1]["rollout/completed"] >= 12
    assert [r["train/actor_version"] for r in rows] == [0, 1, 2]  # step 1 is critic warmup
    assert rows[-1]["rollout/weight_version"] == 2
    assert "actor/loss" in rows[-1] and "critic/explained_variance" in rows[-1]
    # R3 is on by default for an MoE model rolled out by engines: the engine returned every token's
    # routing (the last of each trajectory is never fed to it and does not count). The first actor
    # update trains version 0 on version-0 rollouts: its own fp32 routers agree with the fp32
    # engine's (later ones differ where the rollout is stale).
    for r in rows[1:]:
        assert r["moe/replay_missing_frac"] == 0.0 and r["moe/replay_rank_mb_max"] > 0
    assert rows[1]["moe/routing_agreement"] >= 0.99 and rows[1]["rollout/logprob_abs_diff_mean"] < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_get_their_part_of_the_engines_routing(tmp_path, tiny_hf_dir):
    """EP2 on 2 ranks: rank 0 takes the batch, broadcasts it without routing and sends each rank
    the routing of its own micro-batches; the step replays it (the first update agrees exactly)."""
    code, result, run_dir = run_train(_engine_config(tmp_path, tiny_hf_dir, "engine_ep2", "run.total_steps=2",
                                                     "launcher.nproc_per_node=2", "parallelism.expert=2"))
    assert code == 0 and result["step"] == 2
    last = _rows(run_dir)[-1]
    assert last["moe/replay_missing_frac"] == 0.0 and last["moe/routing_agreement"] >= 0.99
    assert last["moe/replay_rank_mb_max"] < last["moe/replay_batch_mb"]  # each rank: its half of the batch
    assert last["rollout/logprob_abs_diff_mean"] < 1e-4
