"""The ablation study's numbers (`reporting/study.py`), its page, and `sao study` end to end (slow)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_sao.reporting.study import (
    PAPER_CLAIMS,
    RunSummary,
    judge,
    largest_drawdown,
    moving_mean,
    setup_text,
    steps_to_fraction,
    summarise_run,
    variant_table,
    write_study,
)

REPO = Path(__file__).resolve().parents[2]


def test_moving_mean_drawdown_and_steps_to_90():
    assert moving_mean([1, 2, 3, 4], window=2) == [1, 1.5, 2.5, 3.5]
    assert largest_drawdown([0.5, 0.8, 0.6, 0.9, 0.4, 0.7]) == pytest.approx(0.5)
    assert largest_drawdown([0.1, 0.2, 0.3]) == 0.0
    assert steps_to_fraction([1, 2, 3, 4, 5], [0.0, 0.5, 0.85, 0.95, 1.0]) == 4
    assert steps_to_fraction([1, 2, 3], [0.5, 0.4, 0.3]) is None


def _summary(variant: str, heldout: float, seed: int = 1, **kw) -> RunSummary:
    base = {"gain": heldout - 0.2, "drawdown": 0.05, "steps_to_90": 80, "ev_step1": 0.3, "ev_last20": 0.6,
            "masked": 0.01, "staleness": 1.0, "wall_s": 300.0}
    return RunSummary(variant=variant, seed=seed, heldout=heldout, **{**base, **kw})


def test_a_claim_is_reproduced_only_beyond_twice_the_standard_error():
    runs = {"sao": [_summary("sao", h) for h in (0.60, 0.62, 0.64)],
            "grpo_dis": [_summary("grpo_dis", h) for h in (0.40, 0.42, 0.44)],
            "grpo": [_summary("grpo", h) for h in (0.55, 0.70, 0.62)]}
    by_text = {c.better and (c.better, c.worse): c for c in PAPER_CLAIMS}
    verdict, measured = judge(by_text[("sao", "grpo_dis")], runs)
    assert verdict == "reproduced" and measured.startswith("0.620 vs 0.420 (difference +0.200")
    assert judge(by_text[("sao", "grpo")], runs)[0] == "not reproduced (opposite sign, within noise)"
    assert judge(by_text[("grpo_dis", "grpo")], runs)[0] == "not reproduced (opposite sign)"
    assert judge(by_text[("sao", "sao_k1")], runs) == ("not testable at this size", "variant not run")
    assert judge(PAPER_CLAIMS[-1], runs)[0] == "not testable at this size"


def test_the_evaluations_own_noise_floors_a_run_variance():
    """Three seeds that happen to agree closely (sd 0.003) do not make a 0.012 difference real when
    each final evaluation alone has an sd of 0.012 (as in the study's first verdict on value pretraining)."""
    by_text = {c.better and (c.better, c.worse): c for c in PAPER_CLAIMS}
    claim = by_text[("sao", "sao_no_value_pretrain")]
    runs = {"sao": [_summary("sao", h) for h in (0.612, 0.608, 0.615)],
            "sao_no_value_pretrain": [_summary("sao_no_value_pretrain", h) for h in (0.597, 0.602, 0.600)]}
    assert judge(claim, runs)[0] == "reproduced"  # sd over seeds alone: 2 x se 0.005 < difference 0.012
    floored = {v: [replace(s, eval_sd=0.012) for s in ss] for v, ss in runs.items()}
    verdict, measured = judge(claim, floored)
    assert verdict == "not reproduced (same sign, within noise)"
    assert measured.endswith(f"2 x standard error {2 * math.sqrt(2 * 0.012**2 / 3):.3f})")


def test_table_gives_mean_and_sd_and_says_what_is_missing():
    runs = {"sao": [_summary("sao", 0.6), _summary("sao", 0.7, seed=2)],
            "grpo": [_summary("grpo", 0.5, ev_step1=None, ev_last20=None)]}
    table = variant_table(runs, {"sao": "SAO"})
    rows = table.splitlines()
    assert rows[0].startswith("| variant | seeds | held-out success | gain over SFT |")
    assert rows[2].startswith("| SAO | 2 | 0.650 (0.071) | +0.450 (0.071) |")
    assert "| grpo | 1 | 0.500 (0.000) |" in rows[3] and rows[3].count("n/a") == 2


def test_a_run_is_summarised_from_its_metrics_and_the_page_written(tmp_path):
    run = tmp_path / "sao-s1"
    run.mkdir()
    with (run / "metrics.jsonl").open("w") as f:
        for step in range(1, 41):
            reward = 0.5 + 0.01 * step - (0.2 if 20 <= step < 25 else 0.0)
            row = {"step": step, "train/reward_mean": reward, "critic/explained_variance": 0.1 if step == 1 else 0.5,
                   "actor/dis_masked_frac": 0.02, "staleness/mean": 1.5}
            if step == 3:
                row["critic/explained_variance"] = math.nan
            if step % 10 == 0:
                row.update({"eval/success": step / 100, "eval/step": step - 2})
            f.write(json.dumps(row) + "\n")
    s = summarise_run("sao", 1, run / "metrics.jsonl", heldout=0.55, sft_heldout=0.4, wall_s=12.0)
    assert s.gain == pytest.approx(0.15) and s.ev_step1 == 0.1 and s.ev_last20 == pytest.approx(0.5)
    assert s.masked == pytest.approx(0.02) and s.staleness == pytest.approx(1.5)
    assert 0.03 < s.drawdown < 0.2 and s.steps_to_90 is not None
    assert s.eval_steps == [8, 18, 28, 38] and s.eval_success == [0.1, 0.2, 0.3, 0.4]
    page = write_study(tmp_path, {"sao": [s]}, {"sao": "SAO"}, 0.4, 64, "sao study recipes/tiny_cpu.yaml", "setup")
    text = page.read_text()
    assert "Command: `sao study recipes/tiny_cpu.yaml`" in text and "![study](study.png)" in text
    assert (tmp_path / "study.png").stat().st_size > 10_000
    assert "| SAO beats GRPO + DIS" in text and "not testable at this size" in text
    assert json.loads((tmp_path / "study.json").read_text())["runs"]["sao"][0]["heldout"] == 0.55


def test_setup_text_states_what_every_run_shares():
    """The page's setup paragraph from the SAO stage's resolved config (`jobs/study.py` passes it)."""
    from megatron_sao.config import load_config

    rl = load_config(REPO / "recipes" / "tiny_cpu.yaml", ["run.total_steps=30", "data.batch_size=16"])
    text = setup_text(rl, [1, 2], 128, 15, 64, (1.5, 1.0, 1.0), (2.25, 1.0, 1.0))
    assert text.startswith("Every run: 30 steps of 16 trajectories (480 sampled trajectories; GRPO variants: 2 "
                           "prompts x 8)")
    assert "seeds [1, 2]" in text and "Held-out prompts: 128" in text and "the first 64 evaluated" in text
    assert "every 15 steps" in text and "load average 1.5 at the start and 2.2 at the end" in text
    assert "actor lr 0.0002 (cosine to 2e-05)" in text  # the recipe's RL schedule is stated


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_sao_study_end_to_end_small(tmp_path):
    """Two variants, one seed, tiny stages: every artefact is written and a rerun skips the runs."""
    args = [sys.executable, "-m", "megatron_sao.cli", "study", str(REPO / "recipes" / "tiny_cpu.yaml"),
            f"run.output_dir={tmp_path}", f"model.hf_path={tmp_path / 'hf'}", "run.total_steps=3",
            "--seeds", "5", "--variants", "sao,grpo_dis", "--eval-every", "2", "--eval-prompts", "4",
            "--heldout-prompts", "8", "--sft-steps", "10", "--value-steps", "4", "--log-file", str(tmp_path / "log")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=2900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = tmp_path / "tiny_cpu" / "study"
    assert proc.stdout.strip().splitlines()[-1] == f"study: {study / 'study.md'}"
    text = (study / "study.md").read_text()
    assert re.search(r"\| SAO \(K=2, frozen attention\) \| 1 \| \d\.\d{3} \(0\.000\) \|", text), text
    for run in ("sao-s5", "grpo_dis-s5"):
        assert (study / run / "final.json").is_file()
        rows = [json.loads(x) for x in (study / run / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["eval/step"] == 3
    again = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert again.returncode == 0 and "[study] sao-s5: SAO" not in again.stdout
