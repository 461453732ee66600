"""Recorded trajectories as a training source: file order, wrap-around, bad rows skipped and
counted with file and row, state."""

from __future__ import annotations

import json
import math

import pytest

from megatron_sao.rollout.recorded import RecordedTrajectories, load_trajectories
from megatron_sao.rollout.trajectory_io import trajectory_to_dict, write_jsonl, write_parquet
from tests.training.trajectories import random_trajectories


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_batches_in_file_order_with_wrap_around(tmp_path, suffix):
    trajectories = random_trajectories(5, seed=1)
    path = tmp_path / f"t{suffix}"
    (write_parquet if suffix == ".parquet" else write_jsonl)(path, trajectories)
    source = RecordedTrajectories(path, batch_size=2)
    ids = [[t.trajectory_id for t in source.next_batch()] for _ in range(3)]
    assert ids == [["t0", "t1"], ["t2", "t3"], ["t4", "t0"]]
    assert source.epoch == pytest.approx(6 / 5)
    resumed = RecordedTrajectories(path, batch_size=2)
    resumed.load_state_dict(source.state_dict())
    assert [t.trajectory_id for t in resumed.next_batch()] == ["t1", "t2"]


def test_bad_rows_are_skipped_and_counted(tmp_path):
    good = random_trajectories(3, seed=2)
    broken_mask = trajectory_to_dict(good[1])
    broken_mask["loss_mask"][0] = 1  # a prompt token marked as an action
    nan_reward = trajectory_to_dict(good[2])
    nan_reward["rewards"][-1]["value"] = math.nan
    lines = [json.dumps(trajectory_to_dict(good[0])), "{not json", json.dumps(broken_mask),
             json.dumps(nan_reward).replace("NaN", "NaN"), json.dumps(trajectory_to_dict(good[0]))]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    trajectories, report = load_trajectories(path)
    assert len(trajectories) == 2 and report.num_rows == 5 and report.num_skipped == 3
    assert [s.row for s in report.skipped] == [2, 3, 4]
    assert all(s.path == str(path) for s in report.skipped)
    assert "is not finite" in report.skipped[2].detail and "loss_mask" in report.skipped[1].detail


def test_unusable_files_are_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_trajectories(tmp_path / "missing.parquet")
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError, match="unknown format"):
        load_trajectories(tmp_path / "x.csv")
    (tmp_path / "bad.jsonl").write_text("{}\n[]\n")
    with pytest.raises(ValueError, match="no valid trajectory"):
        load_trajectories(tmp_path / "bad.jsonl")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="not a readable Parquet"):
        load_trajectories(tmp_path / "bad.parquet")


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_token_ids_outside_the_vocabulary_are_skipped_and_named(tmp_path, suffix):
    """Issue 32: an id the embedding has no row for (or a negative one) skips its row, counted and
    named with the file, row and position; the rest load."""
    trajectories = random_trajectories(5, seed=7, vocab=100)
    trajectories[1].token_ids[4] = 100  # == vocab_size: one past the last row
    trajectories[3].token_ids[0] = -1
    path = tmp_path / f"t{suffix}"
    (write_parquet if suffix == ".parquet" else write_jsonl)(path, trajectories)
    loaded, report = load_trajectories(path, vocab_size=100)
    assert [t.trajectory_id for t in loaded] == ["t0", "t2", "t4"]
    assert report.counts == {"out_of_vocabulary": 2} and [s.row for s in report.skipped] == [2, 4]
    assert report.skipped[0].detail == "token id 100 at position 4 is outside the model's vocabulary [0, 100)"
    assert "token id -1 at position 0" in report.skipped[1].detail
    assert len(load_trajectories(path)[0]) == 5  # no vocabulary given: nothing to check against
    with pytest.raises(ValueError, match=r"has no valid trajectory \(0/5 rows loaded; skipped: out_of_vocabulary=5\)"):
        RecordedTrajectories(path, batch_size=2, vocab_size=1)


def test_check_trajectory_file_reads_only_the_schema_and_the_first_record(tmp_path):
    from megatron_sao.rollout.recorded import check_trajectory_file

    good = tmp_path / "good.jsonl"
    lines = ["{not json", json.dumps(trajectory_to_dict(random_trajectories(1)[0]))]
    good.write_text("\n".join(lines) + "\n")
    check_trajectory_file(good)  # a bad first line is a bad row (skipped on read), not a wrong schema
    parquet = tmp_path / "good.parquet"
    write_parquet(parquet, random_trajectories(2))
    check_trajectory_file(parquet)
    (tmp_path / "good.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown format"):
        check_trajectory_file(tmp_path / "good.csv")
