"""`tools/plot_metrics.py`: a PNG per run, NaN and missing values skipped, the run's name as title."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "plot_metrics.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _tool():
    spec = importlib.util.spec_from_file_location("plot_metrics", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "dir_name"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("run:\n  name: recorded_ev\n  seed: 1\n")
    with (run / "metrics.jsonl").open("w") as f:
        for step in range(1, 31):
            row = {"step": step, "critic/explained_variance": 1 - math.exp(-step / 8), "actor/loss": 0.1 / step}
            if step % 7 == 0:
                row["actor/loss"] = float("nan")  # json writes NaN; the plot must skip it
            if step < 3:
                del row["critic/explained_variance"]  # not logged during the first steps
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps({"step": 30, "critic/explained_variance": 0.9, "actor/loss": None}) + "\n")
    return run


def test_cli_writes_a_png(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    out = tmp_path / "docs" / "ev.png"
    cmd = [sys.executable, str(TOOL), str(run), "--keys", "critic/explained_variance", "actor/loss", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
                          env={"MPLBACKEND": "TkAgg", "PATH": "/usr/bin:/bin"})  # no display: Agg must be forced
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"wrote {out}"
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000  # two drawn subplots, not an empty canvas


def test_default_output_beside_the_metrics_file(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    assert _tool().main([str(run / "metrics.jsonl")]) == 0  # default keys, some never logged here
    assert (run / "metrics.png").read_bytes().startswith(PNG_SIGNATURE)


def test_series_skips_nan_missing_and_null_and_keeps_the_last_of_a_repeated_step(tmp_path: Path) -> None:
    tool = _tool()
    rows = tool.read_metrics(_run_dir(tmp_path) / "metrics.jsonl")
    steps, values = tool.series(rows, "actor/loss")
    assert steps == [s for s in range(1, 30) if s % 7]  # NaN steps and step 30 (null) left out
    assert all(math.isfinite(v) for v in values)
    steps, values = tool.series(rows, "critic/explained_variance")
    assert steps == list(range(3, 31)) and values[-1] == 0.9


def test_title_is_the_run_name_from_config_else_the_directory(tmp_path: Path) -> None:
    tool = _tool()
    run = _run_dir(tmp_path)
    assert tool.run_name(run / "metrics.jsonl") == "recorded_ev"
    (run / "config.yaml").unlink()
    assert tool.run_name(run / "metrics.jsonl") == "dir_name"


def test_bad_input_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tool = _tool()
    with pytest.raises(SystemExit):
        tool.main([str(tmp_path / "nothing")])
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 1, "a": 1}\n{"a": 2}\n')
    with pytest.raises(SystemExit):
        tool.main([str(bad)])
    assert f"{bad}:2: not a metrics line with a 'step'" in capsys.readouterr().err
