"""The corpus on disk and its streaming, without a model: manifest, split, per-rank row groups,
deterministic shuffles, exact mid-epoch resume, and every kind of bad input."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest

from megatron_sao.config import load_config
from megatron_sao.rollout.datasets import LoadReport
from megatron_sao.valuepretrain.check import BadShardError, check_shards, handle_bad_shards
from megatron_sao.valuepretrain.corpus import (
    Manifest,
    is_heldout,
    read_manifest,
    sha256_file,
    write_corpus,
    write_manifest,
    write_shard,
)
from megatron_sao.valuepretrain.evaluate import CalibrationBin, HeldoutResult, mc_returns
from megatron_sao.valuepretrain.settings import check_value_pretrain_config
from megatron_sao.valuepretrain.stream import RankStream, plan_units, read_split
from tests.training.trajectories import random_trajectories


@pytest.fixture
def corpus(tmp_path):
    trajectories = random_trajectories(60, seed=4)
    manifest = write_corpus(tmp_path / "corpus", trajectories, seed=7, heldout_fraction=0.25,
                            trajectories_per_shard=16, row_group_size=3)
    return tmp_path / "corpus", manifest, trajectories


def test_manifest_records_every_shard_exactly(corpus):
    corpus_dir, manifest, trajectories = corpus
    again = read_manifest(corpus_dir)
    assert [s.name for s in again.shards] == sorted(s.name for s in manifest.shards)
    held = [t for t in trajectories if is_heldout(t.prompt_id, 7, 0.25)]
    assert 0 < len(held) < len(trajectories)
    totals = again.totals()
    assert totals["heldout"]["trajectories"] == len(held)
    assert totals["train"]["trajectories"] + len(held) == len(trajectories)
    assert totals["train"]["tokens"] + totals["heldout"]["tokens"] == sum(len(t) for t in trajectories)
    rewards = [t.total_reward for t in trajectories if not is_heldout(t.prompt_id, 7, 0.25)]
    assert math.isclose(totals["train"]["reward"]["mean"], sum(rewards) / len(rewards))
    assert totals["train"]["reward"]["max"] == max(rewards)
    for shard in again.shards:
        path = corpus_dir / shard.name
        assert sha256_file(path) == shard.sha256 and path.stat().st_size == shard.num_bytes
        metadata = pq.ParquetFile(path).metadata
        assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == shard.row_groups
        assert sum(shard.row_groups) == shard.num_rows and max(shard.row_groups) <= 3
    assert not list(corpus_dir.glob("*.tmp"))


def test_ranks_read_disjoint_row_groups_covering_the_epoch(corpus):
    corpus_dir, manifest, _ = corpus
    shards = manifest.split("train")
    total = sum(s.num_rows for s in shards)
    streams = [RankStream(corpus_dir, shards, seed=3, dp_rank=r, dp_size=2) for r in range(2)]
    seen = []
    for stream in streams:
        units = stream._order
        rows = stream.next_batch(sum(u.num_rows for u in units))
        assert stream.epoch == 0
        seen.append([t.trajectory_id for t in rows])
    assert not set(seen[0]) & set(seen[1])
    assert len(seen[0]) + len(seen[1]) == total
    # Same seed, same stream; another seed or another epoch, another order.
    same = RankStream(corpus_dir, shards, seed=3, dp_rank=0, dp_size=2).next_batch(len(seen[0]))
    other = RankStream(corpus_dir, shards, seed=4, dp_rank=0, dp_size=2).next_batch(len(seen[0]))
    assert [t.trajectory_id for t in same] == seen[0]
    assert [t.trajectory_id for t in other] != seen[0]
    next_epoch = streams[0].next_batch(len(seen[0]))
    assert streams[0].epoch >= 1 and [t.trajectory_id for t in next_epoch] != seen[0]


def test_stream_resumes_mid_epoch_exactly(corpus):
    corpus_dir, manifest, _ = corpus
    shards = manifest.split("train")
    straight = RankStream(corpus_dir, shards, seed=5, dp_rank=1, dp_size=2)
    for _ in range(3):
        straight.next_batch(5)
    state = json.loads(json.dumps(straight.state_dict()))  # as it travels through trainer_state.json
    assert state["epoch"] == 0 and state["row"] > 0  # mid-epoch and mid row group
    expected = [t.trajectory_id for _ in range(8) for t in straight.next_batch(5)]  # crosses into epoch 1
    resumed = RankStream(corpus_dir, shards, seed=5, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    assert [t.trajectory_id for _ in range(8) for t in resumed.next_batch(5)] == expected


def test_too_few_row_groups_for_the_ranks_is_refused(corpus):
    corpus_dir, manifest, _ = corpus
    with pytest.raises(ValueError, match="row groups for 1000 data-parallel ranks"):
        RankStream(corpus_dir, manifest.split("train"), seed=0, dp_rank=0, dp_size=1000)


def _bad_rows_shard(tmp_path):
    trajs = random_trajectories(8, seed=2)
    trajs[1].loss_mask.append(1)  # token / mask lengths disagree
    trajs[3].rollout_logprobs.pop()  # token / log-prob lengths disagree
    trajs[4].rewards[-1].value = float("nan")
    trajs[5].rewards[-1].value = float("inf")
    trajs[6].policy_versions[trajs[6].prompt_length] = -1  # an action token without a version
    trajs[7].status = "exploded"  # not a status: not a record at all
    corpus_dir = tmp_path / "bad"
    corpus_dir.mkdir()
    info = write_shard(corpus_dir, "train-00000.parquet", trajs, row_group_size=3)
    write_manifest(corpus_dir, Manifest(shards=[info]))
    return corpus_dir, info


def test_bad_rows_are_skipped_and_reported_with_shard_and_row(tmp_path):
    corpus_dir, info = _bad_rows_shard(tmp_path)
    stream = RankStream(corpus_dir, [info], seed=0, dp_rank=0, dp_size=1)
    good = stream.next_batch(4)  # one epoch holds exactly rows 1, 3 (1-based)
    assert sorted(t.trajectory_id for t in good) == ["t0", "t0", "t2", "t2"]
    report = stream.report
    skipped = {(s.row, s.reason) for s in report.skipped}
    assert skipped == {(2, "length_mismatch"), (4, "length_mismatch"), (5, "non_finite_reward"),
                       (6, "non_finite_reward"), (7, "invalid_record"), (8, "bad_record")}
    assert all(s.path.endswith("train-00000.parquet") for s in report.skipped)
    assert report.num_skipped == 6 and report.num_loaded == 2  # counted once, not once per epoch
    held = read_split(corpus_dir, [info], 100, heldout := LoadReport())
    assert len(held) == 2 and heldout.num_skipped == 6


def test_corrupt_truncated_and_missing_shards_are_reported(corpus):
    corpus_dir, manifest, _ = corpus
    names = [s.name for s in manifest.split("train")]
    flipped, truncated, missing = (corpus_dir / n for n in names[:3])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    missing.unlink()
    problems = check_shards(corpus_dir, manifest.shards, verify_hash=True)
    assert [(p.name, p.reason) for p in problems] == [(names[0], "hash_mismatch"), (names[1], "hash_mismatch"),
                                                      (names[2], "missing")]
    unhashed = check_shards(corpus_dir, manifest.shards, verify_hash=False)
    assert (names[1], "unreadable") in [(p.name, p.reason) for p in unhashed]
    handle_bad_shards(problems, "skip")  # reported, not fatal
    with pytest.raises(BadShardError, match=names[0]):
        handle_bad_shards(problems, "stop")


def test_unreadable_row_group_while_streaming_skips_or_stops(corpus):
    corpus_dir, manifest, _ = corpus
    shards = manifest.split("train")
    victim = corpus_dir / shards[0].name
    data = bytearray(victim.read_bytes())
    data[4:200] = bytes(196)  # the first row groups' pages, footer intact
    victim.write_bytes(bytes(data))
    total = sum(s.num_rows for s in shards)
    stream = RankStream(corpus_dir, shards, seed=1, dp_rank=0, dp_size=1, on_bad_shard="skip")
    stream.next_batch(total)  # more than the readable rows: wraps into epoch 1
    assert stream.bad_units and all(p.name == shards[0].name for p in stream.bad_units)
    stopping = RankStream(corpus_dir, shards, seed=1, dp_rank=0, dp_size=1, on_bad_shard="stop")
    with pytest.raises(BadShardError, match=shards[0].name):
        stopping.next_batch(total)


def test_explained_variance_without_spread_is_undefined_not_a_number():
    result = HeldoutResult(step=3, num_trajectories=4, num_tokens=20, explained_variance=math.nan, value_mse=0.1,
                           bins=[CalibrationBin(0.0, 1.0, 20, 0.4, 0.5)])
    assert "eval/explained_variance" not in result.metrics()
    assert result.metrics()["eval/explained_variance_defined"] == 0.0
    assert result.to_dict()["explained_variance"] is None
    assert "undefined" in result.ev_text() and "undefined" in result.to_dict()["explained_variance_note"]
    json.dumps(result.to_dict(), allow_nan=False)  # valid JSON: no NaN literal a reader could compare


def test_monte_carlo_returns_skip_observations_and_discount():
    traj = random_trajectories(1, seed=8)[0]
    returns = mc_returns(traj, gamma=0.5)
    assert len(returns) == traj.num_action_tokens
    assert returns[-1] == pytest.approx(sum(r.value for r in traj.rewards if r.position == max(
        t for t, m in enumerate(traj.loss_mask) if m)))
    assert mc_returns(traj, gamma=1.0)[0] == pytest.approx(traj.total_reward)


@pytest.mark.parametrize("override, message", [
    ("value_pretrain.samples_per_prompt=0", "value_pretrain.samples_per_prompt"),
    ("value_pretrain.heldout_fraction=1.0", "value_pretrain.heldout_fraction"),
    ("value_pretrain.row_group_size=0", "value_pretrain.row_group_size"),
    ("algorithm.advantage=running_mean", "algorithm.advantage"),
    ("data.batch_size=3", "data.batch_size"),
])
def test_unusable_settings_name_their_key(tmp_path, override, message):
    config = load_config(None, ["launcher.nproc_per_node=2", f"value_pretrain.corpus_dir={tmp_path}", override])
    with pytest.raises(ValueError, match=message):
        check_value_pretrain_config(config, for_training=True)


def test_units_follow_file_order(corpus):
    _, manifest, _ = corpus
    units = plan_units(manifest.split("train"))
    assert units[0].first_row == 1 and units[1].first_row == 1 + units[0].num_rows
