"""`sao online`: the shifting-reward recipe end to end with tiny stages (two RL runs, compared)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_online_runs_both_estimators_and_compares_them(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_sao.cli", "online", str(REPO / "recipes" / "tiny_cpu_online.yaml"),
         f"run.output_dir={tmp_path}", f"model.hf_path={tmp_path / 'hf'}", "data.batch_size=4",
         "rollout.environment_kwargs.phase_length=8", "--sft-steps", "10", "--value-steps", "4"],
        capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("comparison: ") and Path(lines[-1].removeprefix("comparison: ")).is_file()
    assert lines[-3].startswith("critic: phase 0 (result)") and lines[-2].startswith("running_mean: phase 0")
    base = tmp_path / "tiny_cpu_online"
    from megatron_sao.rollout.trajectory_io import read_parquet

    # SFT data in both styles (calc_shift.mixed_oracle): `result` episodes call the tool (2 turns),
    # `echo` episodes answer at once (1 turn), so the SFT policy can sample either.
    turns = {len(t.turns) for t in read_parquet(base / "demonstrations.parquet")}
    assert turns == {1, 2}
    for name in ("online_critic", "online_running_mean"):
        rows = (base / name / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == 6  # 3 phases x 2 steps
    page = (base / "online_report" / "index.html").read_text()
    assert "Adaptation per phase (2 steps each)" in page


def test_online_recipe_keeps_a_constant_actor_rate():
    """The base recipe's decaying rate (tiny_cpu.yaml, for the demo) would leave the later phases
    of the shifting reward a smaller step than the first."""
    from megatron_sao.config import load_config

    optim = load_config(REPO / "recipes" / "tiny_cpu_online.yaml").actor.optim
    assert (optim.lr_decay_style, optim.min_lr, optim.lr) == ("constant", 0.0, 5e-5)
