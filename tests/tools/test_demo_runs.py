"""tools/demo_runs/summarize.py: the table of demo runs over seeds (docs/pipeline.md)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _summarize_module():
    spec = importlib.util.spec_from_file_location("demo_runs_summarize", REPO / "tools/demo_runs/summarize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(root: Path, seed: int, sft: float, sao: float, evs: list[float]) -> None:
    base = root / f"s{seed}_r1" / "tiny_cpu"
    (base / "sao").mkdir(parents=True)
    by_tier = {"sft": {"all": sft, "t0_a": 0.9, "t3_b": 0.0}, "sao": {"all": sao, "t0_a": 1.0, "t3_b": 0.0}}
    (base / "heldout.json").write_text(json.dumps({"sft": sft, "sao": sao, "num_prompts": 1024, "by_tier": by_tier,
                                                   "tier_counts": {"t0_a": 512, "t3_b": 512}}))
    rows = [{"step": i + 1, "critic/explained_variance": ev, "train/success_rate": 0.5, "staleness/mean": 2.0}
            for i, ev in enumerate(evs)]
    (base / "sao" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with (root / "results.txt").open("a") as f:
        f.write(f"seed={seed} repeat=1 rc=0 wall=100s held-out success: sft={sft:.3f} sao={sao:.3f} (1024 prompts)\n")


def test_table_states_the_noise_and_counts_runs_beyond_it(tmp_path, capsys):
    _run(tmp_path, 1, 0.55, 0.65, [0.1] * 5 + [0.7] * 20)
    _run(tmp_path, 2, 0.55, 0.57, [0.2] * 19 + [float("nan")])  # within the noise; one EV not reported
    (tmp_path / "results.txt").open("a").write("seed=3 repeat=1 rc=1 wall=5s \n")  # a failed run is named
    _summarize_module().main(tmp_path)
    out = capsys.readouterr().out
    noise = 1.96 * math.sqrt(0.55 * 0.45 / 1024 + 0.65 * 0.35 / 1024)
    tier_noise = 1.96 * math.sqrt(512 * (0.9 * 0.1 + 0.0)) / 1024  # the unsolved tier adds nothing
    assert f"| 1 | 1 | 0.550 | 0.650 | +0.100 | {noise:.3f} / {tier_noise:.3f} | 0.10 | 0.70 (0) |" in out
    assert "| 2 | 1 | 0.550 | 0.570 | +0.020 |" in out and "| 0.20 (1) |" in out
    assert "| 0.50 / 0.50 | 2.00 | t0 0.90->1.00 t3 0.00->0.00 | 100 |" in out
    assert "not a finished run: seed=3" in out
    assert "SAO > SFT in 2; gain beyond the evaluation's noise in 1 of 2 (pooled), 2 of 2 (per tier)" in out
    assert "(>= 0.5 in 1 of 2)" in out
