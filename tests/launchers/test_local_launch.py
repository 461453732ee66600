"""`sao launch local`: the Slurm job's flow on this machine (launchers/local/run.sh): a one-node Ray
cluster, the join barrier, the driver (`sao train` on its local ranks), Ray torn down, the driver's
exit code returned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_sao.cli import main
from megatron_sao.rollout.trajectory_io import write_parquet
from tests.training.trajectories import random_trajectories

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml")


def _common(tmp_path: Path) -> list[str]:
    trajectories = tmp_path / "trajectories.parquet"
    write_parquet(trajectories, random_trajectories(32, seed=3))
    return [f"run.output_dir={tmp_path}", f"data.trajectories_path={trajectories}", "run.total_steps=2",
            "critic.warmup_steps=0", "logging.wandb_mode=disabled", "logging.param_table=false"]


# Slow (~55 s). The default suite keeps the launch flow through test_slurm_jobs.py's failing job (Ray
# across the nodes, the driver's exit code) and `sao train` on the tiny recipe through test_cli.py.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_launch_trains_the_tiny_recipe(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "local", RECIPE, *_common(tmp_path)]) == 0
    out = capfd.readouterr().out
    assert "Ray cluster complete: 1 nodes" in out and "sao-local" in out and "driver exited with 0" in out
    rows = [json.loads(line) for line in (tmp_path / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "tiny_cpu" / "checkpoints" / "iter_0000002").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_launch_returns_a_failing_drivers_exit_code(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A user error in the driver is the launch's exit code, after Ray is torn down: token ids no
    row of the model's vocabulary holds, found by the ranks as they read the file (the launch's own
    checks read only its schema), come back as the driver's one-line user error."""
    out_of_vocab = tmp_path / "out_of_vocab.parquet"
    write_parquet(out_of_vocab, random_trajectories(8, seed=4, vocab=1_000_000))
    assert main(["launch", "local", RECIPE, *_common(tmp_path), f"data.trajectories_path={out_of_vocab}"]) == 2
    captured = capfd.readouterr()
    assert "driver exited with 2" in captured.out
    assert f"sao train: error: trajectory file {out_of_vocab} has no valid trajectory" in captured.err
    assert "out_of_vocabulary=8" in captured.err and "Traceback" not in captured.err
