"""Live progress of a stage (`utils/progress.py`): the line's fields, redrawn in place on a
terminal, periodic plain lines in a log or pipe, and a real `sao train` seen in a tmux pane."""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_sao.utils.progress import CLEAR_LINE, StageProgress, format_duration, format_progress

ROW = {"train/reward_mean": 0.8461, "train/success_rate": 0.78125, "critic/explained_variance": 0.4213,
       "critic/value_loss": 0.01, "staleness/mean": 1.31, "perf/tokens_per_s": 2140.0}


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _append(path: Path, step: int, **extra: float) -> None:
    with path.open("a") as f:
        f.write(json.dumps({"step": step, **ROW, **extra}) + "\n")


def test_the_line_has_every_field_and_an_eta():
    line = format_progress("sao", 37, 150, {**ROW}, eval_success=0.62, eta_s=125)
    assert line == ("[sao] step 37/150 | reward 0.846 | success 0.781 | EV 0.42 | stale 1.3 | 2.1k tok/s | "
                    "eval 0.620 | ETA 2m05s")
    unreported = format_progress("sao", 3, 150, {**ROW, "critic/explained_variance": math.nan})
    assert "| EV n/a |" in unreported and unreported.endswith("ETA --")
    sft = format_progress("sft", 10, 200, {"actor/loss": 1.2345, "perf/tokens_per_s": 900.0}, eta_s=3700)
    assert sft == "[sft] step 10/200 | loss 1.234 | 900 tok/s | ETA 1h01m"
    assert format_duration(59.6) == "1m00s" and format_duration(-3) == "0s"


def test_on_a_terminal_the_line_is_redrawn_in_place(tmp_path):
    path, clock, out = tmp_path / "metrics.jsonl", _Clock(), _Terminal()
    progress = StageProgress("sao", path, 150, out, clock=clock)
    assert progress.tty
    progress.poll()
    assert out.getvalue() == ""  # nothing before the first step
    _append(path, 1)
    progress.poll()
    clock.now += 10
    _append(path, 11)
    progress.poll()
    text = out.getvalue()
    assert "\n" not in text and text.count(CLEAR_LINE) == 2  # one line, redrawn at every new step
    assert text.rsplit(CLEAR_LINE, 1)[1] == format_progress("sao", 11, 150, ROW, eta_s=139)
    progress.poll()  # no new row: not redrawn
    assert out.getvalue().count(CLEAR_LINE) == 2
    clock.now += 139
    _append(path, 150, **{"eval/success": 0.7})
    progress.close()
    last = out.getvalue().rsplit(CLEAR_LINE, 1)[1]
    assert last == format_progress("sao", 150, 150, ROW, eval_success=0.7, eta_s=0) + "\n"


def test_in_a_log_or_pipe_plain_lines_come_every_interval(tmp_path):
    path, clock, out = tmp_path / "metrics.jsonl", _Clock(), io.StringIO()
    progress = StageProgress("sao", path, 150, out, interval_s=30, clock=clock)
    assert not progress.tty
    _append(path, 1)
    progress.poll()  # the first step: a line at once
    clock.now += 10
    _append(path, 11)
    progress.poll()  # 10 s later: not yet
    clock.now += 25
    _append(path, 21)
    progress.poll()  # 35 s after the last line: one more
    clock.now += 5
    _append(path, 22)
    progress.close()  # the end: the last line
    lines = out.getvalue().splitlines(keepends=True)
    assert "\r" not in out.getvalue() and all(line.endswith("\n") for line in lines)
    assert [re.search(r"step (\d+)/", line).group(1) for line in lines] == ["1", "21", "22"]
    assert lines[1].strip() == format_progress("sao", 21, 150, ROW, eta_s=(150 - 21) / 20 * 35)


def test_rows_of_an_earlier_attempt_are_not_shown_and_a_rewrite_is_followed(tmp_path):
    path, clock, out = tmp_path / "metrics.jsonl", _Clock(), io.StringIO()
    for step in (1, 2, 3):
        _append(path, step)
    progress = StageProgress("sao", path, 10, out, interval_s=0, clock=clock)
    progress.skip_existing()
    progress.poll()
    assert out.getvalue() == ""
    path.write_text(json.dumps({"step": 2, **ROW}) + "\n")  # a resume keeps the rows up to its checkpoint
    _append(path, 3)
    progress.poll()
    assert [re.search(r"step (\d+)/", line).group(1) for line in out.getvalue().splitlines()] == ["3"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_sao_train_in_a_terminal_shows_one_line_redrawn_in_place(tmp_path, tiny_hf_dir):
    """What a person sees: `sao train` in a tmux pane (a real terminal), the pane captured after
    the run. The progress line is there once (redrawn, not repeated), at its last step."""
    from megatron_sao.config.loader import config_to_dict
    from tests.pipeline.test_engine_training import _engine_config

    config = _engine_config(tmp_path, tiny_hf_dir, "watched", "run.total_steps=4")
    recipe = tmp_path / "watched.yaml"
    recipe.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    session = f"sao-progress-{int(time.time() * 1000)}"
    done = tmp_path / "done"
    command = (f"cd {Path(__file__).resolve().parents[2]} && {sys.executable} -m megatron_sao.cli train {recipe} "
               f"2>{tmp_path / 'stderr.log'}; echo $? > {done}; sleep 600")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50", command], check=True)
    try:
        deadline = time.monotonic() + 800
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(2)
        pane = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert done.read_text().strip() == "0", pane
    lines = [line for line in pane.splitlines() if line.startswith("[watched] step ")]
    assert len(lines) == 1, pane
    assert re.fullmatch(r"\[watched\] step 4/4 \| reward \d\.\d{3} \| success \d\.\d{3} \| EV (-?\d+\.\d\d|n/a) \| "
                        r"stale \d+\.\d \| [\d.]+k? tok/s \| ETA 0s", lines[0].rstrip()), lines[0]
