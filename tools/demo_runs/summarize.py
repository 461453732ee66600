"""The table of `tools/demo_runs/run.sh`'s runs (docs/pipeline.md, "Runs over seeds").

Per run: held-out SFT / SAO success, the gain, the evaluation's noise on that gain
(`reporting/heldout_noise.py`: 1.96 sd, pooled over all prompts and per difficulty tier; the tiers'
prompt counts from `heldout.json`, or for runs older than that field regenerated from the seed
as the demo drew them), the SAO stage's critic explained variance
(step 1; mean of the last 20 steps' reported values, and how many were not reported), training
success over the first / last 15 steps, staleness (mean over steps of the batch's mean, in actor
versions), success per tier, wall seconds.

    python tools/demo_runs/summarize.py OUT_ROOT
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from pathlib import Path

LINE = re.compile(r"seed=(\d+) repeat=(\d+) rc=(\d+) wall=(\d+)s held-out success")


def _reported(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def heldout_tier_counts(held: dict, seed: int) -> dict[str, int]:
    """Prompts per tier: from `heldout.json`, or regenerated from the seed for runs older than it."""
    if "tier_counts" in held:
        return held["tier_counts"]
    import tempfile

    from megatron_sao.jobs.demo import tier_counts
    from megatron_sao.jobs.demo_plan import DemoPlan, prompt_files

    with tempfile.TemporaryDirectory() as tmp:
        _, heldout = prompt_files(Path(tmp), DemoPlan(num_heldout_prompts=held["num_prompts"]), seed)
    return tier_counts(heldout)


def summarise_run(run_dir: Path, seed: int, repeat: int, wall: int) -> dict:
    from megatron_sao.reporting.heldout_noise import per_tier_noise, pooled_noise

    held = json.loads((run_dir / "heldout.json").read_text())
    lines = (run_dir / "sao" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines if line.strip()]
    last = [m.get("critic/explained_variance") for m in metrics[-20:]]
    reported = [float(v) for v in last if _reported(v)]  # type: ignore[arg-type]
    success = [m["train/success_rate"] for m in metrics if "train/success_rate" in m]
    stale = [float(m["staleness/mean"]) for m in metrics if _reported(m.get("staleness/mean"))]
    sft, sao, n = held["sft"], held["sao"], held["num_prompts"]
    tiers = " ".join(f"{k.split('_')[0]} {held['by_tier']['sft'][k]:.2f}->{held['by_tier']['sao'][k]:.2f}"
                     for k in held["by_tier"]["sft"] if k != "all")
    return {"seed": seed, "repeat": repeat, "sft": sft, "sao": sao, "gain": sao - sft,
            "noise": pooled_noise(sft, sao, n),
            "tier_noise": per_tier_noise(held["by_tier"]["sft"], held["by_tier"]["sao"],
                                         heldout_tier_counts(held, seed)),
            "ev1": metrics[0].get("critic/explained_variance", float("nan")),
            "ev20": statistics.fmean(reported) if reported else float("nan"), "unreported": len(last) - len(reported),
            "success": (statistics.fmean(success[:15]), statistics.fmean(success[-15:])), "tiers": tiers, "wall": wall,
            "staleness": statistics.fmean(stale) if stale else float("nan")}


def main(root: Path) -> None:
    runs = []
    for line in (root / "results.txt").read_text().splitlines():
        match = LINE.search(line)
        if match is None:
            print(f"not a finished run: {line}")
            continue
        seed, repeat, _, wall = (int(g) for g in match.groups()[:4])
        runs.append(summarise_run(root / f"s{seed}_r{repeat}" / "tiny_cpu", seed, repeat, wall))
    print("| seed | repeat | SFT | SAO | gain | noise pooled / per tier | critic EV step 1 "
          "| critic EV last 20 (not reported) | train success first/last 15 steps | staleness | per tier SFT->SAO "
          "| wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(runs, key=lambda r: (r["seed"], r["repeat"])):
        print(f"| {r['seed']} | {r['repeat']} | {r['sft']:.3f} | {r['sao']:.3f} | {r['gain']:+.3f} "
              f"| {r['noise']:.3f} / {r['tier_noise']:.3f} "
              f"| {r['ev1']:.2f} | {r['ev20']:.2f} ({r['unreported']}) | {r['success'][0]:.2f} / {r['success'][1]:.2f} "
              f"| {r['staleness']:.2f} | {r['tiers']} | {r['wall']} |")
    if runs:
        gains = [r["gain"] for r in runs]
        print(f"\nRuns {len(runs)}; SAO > SFT in {sum(g > 0 for g in gains)}; gain beyond the evaluation's noise in "
              f"{sum(r['gain'] > r['noise'] for r in runs)} of {len(runs)} (pooled), "
              f"{sum(r['gain'] > r['tier_noise'] for r in runs)} of {len(runs)} (per tier); "
              f"gain mean {statistics.fmean(gains):+.3f}"
              + (f", sd {statistics.stdev(gains):.3f}" if len(gains) > 1 else "") + f", min {min(gains):+.3f}; "
              f"critic EV last 20 steps {min(r['ev20'] for r in runs):.2f}-{max(r['ev20'] for r in runs):.2f} "
              f"(>= 0.5 in {sum(r['ev20'] >= 0.5 for r in runs)} of {len(runs)})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/demo_runs/summarize.py OUT_ROOT")
    main(Path(sys.argv[1]))
