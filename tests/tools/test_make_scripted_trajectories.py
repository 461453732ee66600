"""`tools/make_scripted_trajectories.py`: writes what the library makes, says so in one line, and
does nothing the second time with the same arguments."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sao.rollout.scripted_trajectories import make_scripted_trajectories
from megatron_sao.rollout.trajectory_io import read_jsonl, read_parquet, trajectory_to_dict

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "make_scripted_trajectories.py"
WROTE = re.compile(r"^wrote (\d+) trajectories \((\d+) tokens, success rate (0\.\d{3}|1\.000)\) to (.+)$")


def _tool():
    spec = importlib.util.spec_from_file_location("make_scripted_trajectories", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_cli_builds_a_tiny_checkpoint_writes_jsonl_and_reports(tmp_path: Path) -> None:
    hf, out = tmp_path / "hf", tmp_path / "data" / "t.jsonl"
    cmd = [sys.executable, str(TOOL), "--hf", str(hf), "--build-tiny", "--out", str(out), "--num", "12", "--seed", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    match = WROTE.match(_last_line(done.stdout))
    assert match, done.stdout
    written = read_jsonl(out)
    assert int(match[1]) == len(written) == 12
    assert int(match[2]) == sum(len(t) for t in written)
    assert float(match[3]) == pytest.approx(sum(t.terminal_reward for t in written) / 12, abs=5e-4)
    assert match[4] == str(out)
    expected = make_scripted_trajectories(hf, 12, seed=1)
    assert [trajectory_to_dict(t) for t in written] == [trajectory_to_dict(t) for t in expected]


def test_second_run_with_the_same_arguments_keeps_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tool = _tool()
    hf, out = tmp_path / "hf", tmp_path / "t.parquet"
    args = ["--hf", str(hf), "--build-tiny", "--out", str(out), "--num", "8", "--seed", "2"]
    assert tool.main(args) == 0
    first = capsys.readouterr().out
    assert WROTE.match(_last_line(first))
    mtime = out.stat().st_mtime_ns
    assert tool.main(args) == 0
    second = _last_line(capsys.readouterr().out)
    assert second.startswith("kept 8 trajectories (") and second.endswith(f"in {out} (up to date)")
    assert second[len("kept ") :].split(" in ")[0] == _last_line(first)[len("wrote ") :].split(" to ")[0]
    assert out.stat().st_mtime_ns == mtime
    # Another seed (or group size, or count) rewrites it.
    assert tool.main([*args[:-1], "3"]) == 0
    assert WROTE.match(_last_line(capsys.readouterr().out))
    assert out.stat().st_mtime_ns != mtime
    assert len(read_parquet(out)) == 8


def test_group_size_reaches_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "g.jsonl"
    assert _tool().main(["--hf", str(tmp_path / "hf"), "--build-tiny", "--out", str(out), "--num", "8",
                         "--group-size", "4"]) == 0
    assert [t.prompt_id for t in read_jsonl(out)].count(read_jsonl(out)[0].prompt_id) == 4


def test_recipe_builds_and_uses_its_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--recipe` takes the recipe's model (built tiny, with its architecture overrides) and overrides."""
    import json

    hf, out = tmp_path / "hf", tmp_path / "r.jsonl"
    argv = ["--recipe", str(ROOT / "recipes" / "tiny_cpu.yaml"), f"model.hf_path={hf}", "model.num_experts=2",
            "parallelism.expert=1", "--out", str(out), "--num", "4"]
    assert _tool().main(argv) == 0
    assert WROTE.match(_last_line(capsys.readouterr().out))
    assert json.loads((hf / "config.json").read_text())["num_local_experts"] == 2  # HF name of num_experts
    expected = make_scripted_trajectories(hf, 4, seed=0)
    assert [trajectory_to_dict(t) for t in read_jsonl(out)] == [trajectory_to_dict(t) for t in expected]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--out", "x.csv", "--num", "4"], "must end in .parquet or .jsonl"),
        (["--out", "x.jsonl", "--num", "6", "--group-size", "4"], "multiple of --group-size"),
        (["--out", "x.jsonl", "--num", "4"], "no config.json there; pass --build-tiny"),
    ],
)
def test_user_errors_name_the_argument(tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str],
                                       message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _tool().main(["--hf", str(tmp_path / "missing"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
