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
