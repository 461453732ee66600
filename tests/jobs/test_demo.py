"""`sao demo`: the whole recipe (convert, SFT, value pretraining, SAO through CPU engines,
held-out evaluation) end to end on the tiny model, with small stages."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_demo_runs_every_stage_and_reports_heldout_success(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_sao.cli", "demo", str(REPO / "recipes" / "tiny_cpu.yaml"),
         f"run.output_dir={tmp_path}", f"model.hf_path={tmp_path / 'hf'}", "run.total_steps=3",
         "--sft-steps", "10", "--value-steps", "4", "--heldout-prompts", "8"],
        capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"held-out success: sft=\d\.\d{3} sao=\d\.\d{3} \(8 prompts\)", lines[-1]), lines[-1]
    assert lines[-2].startswith("report: ") and Path(lines[-2].removeprefix("report: ")).is_file()
    base = tmp_path / "tiny_cpu"
    for stage in ("mcore", "sft", "sft_hf", "value", "value_corpus", "sao", "sao_hf"):
        assert (base / stage).is_dir(), stage
