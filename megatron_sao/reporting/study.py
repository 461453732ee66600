"""The ablation study's numbers, table, figure and claims comparison (`sao study`, jobs/study.py).

Per run (one variant, one seed) from its `metrics.jsonl` and its final held-out evaluation:

    heldout          final policy's held-out success (the study's final evaluation, same prompts for all)
    gain             heldout - the SFT policy's held-out success on the same prompts
    drawdown         largest fall of the training reward (moving mean over `SMOOTH` steps) below its
                     running peak: how far a run slid back before recovering (or not)
    steps_to_90      first step at which that smoothed reward covered 90% of its rise from the first
                     window to the last (None when it did not rise)
    ev_step1         critic explained variance at step 1 (value pretraining's effect), ev_last20 the
                     mean over the last 20 steps that report one (None without a critic)
    masked           DIS masked fraction (DIS losses) or PPO clip fraction (PPO), mean over steps
    staleness        mean of the per-batch mean staleness (actor versions)
    wall_s           wall time of the RL stage
    eval_sd          sd of `heldout` from the final evaluation's sampling alone (per difficulty tier,
                     `reporting/heldout_noise.evaluation_sd`)
and per variant the mean and the sd over seeds. A claim of the paper "A beats B" counts as
reproduced when the mean held-out success of A exceeds B's by more than twice the standard error
of the difference; otherwise not reproduced, saying whether the sign agreed. A variant's variance
per run is its sd over seeds squared, but never less than its evaluation's own variance
(`eval_sd` squared): the final evaluation's noise is part of every run's result, and an sd over 3
seeds can land far below it by chance.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SMOOTH = 10
"""Steps in the moving mean of the training reward (drawdown, steps to 90%, the figure)."""


@dataclass(kw_only=True)
class RunSummary:
    variant: str
    seed: int
    heldout: float
    gain: float
    drawdown: float
    steps_to_90: int | None
    ev_step1: float | None
    ev_last20: float | None
    masked: float | None
    staleness: float | None
    wall_s: float
    eval_sd: float | None = None
    steps: list[int] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    eval_steps: list[float] = field(default_factory=list)
    eval_success: list[float] = field(default_factory=list)


def _rows(metrics_path: Path) -> list[dict[str, Any]]:
    from megatron_sao.reporting.metrics import read_metrics

    return list(read_metrics(metrics_path).values())


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]


def moving_mean(values: Sequence[float], window: int = SMOOTH) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def largest_drawdown(values: Sequence[float]) -> float:
    """Largest peak-to-later-trough fall of `values` (0 for a curve that never falls)."""
    peak, worst = -math.inf, 0.0
    for v in values:
        peak = max(peak, v)
        worst = max(worst, peak - v)
    return worst


def steps_to_fraction(steps: Sequence[int], smoothed: Sequence[float], fraction: float = 0.9) -> int | None:
    """First step where `smoothed` covers `fraction` of its rise from start to end (None: no rise)."""
    if len(smoothed) < 2:
        return None
    start, end = smoothed[0], smoothed[-1]
    if end <= start:
        return None
    target = start + fraction * (end - start)
    return next(s for s, v in zip(steps, smoothed, strict=True) if v >= target)


def summarise_run(variant: str, seed: int, metrics_path: Path, heldout: float, sft_heldout: float,
                  wall_s: float, eval_sd: float | None = None) -> RunSummary:
    rows = _rows(metrics_path)
    steps = [r["step"] for r in rows if "train/reward_mean" in r]
    reward = [float(r["train/reward_mean"]) for r in rows if "train/reward_mean" in r]
    smoothed = moving_mean(reward)
    evs = [(r["step"], r.get("critic/explained_variance")) for r in rows if "critic/explained_variance" in r]
    finite_evs = _finite([v for _, v in evs])
    ev_step1 = next((float(v) for s, v in evs if s == 1 and isinstance(v, float) and math.isfinite(v)), None)
    masked_key = "actor/dis_masked_frac" if any("actor/dis_masked_frac" in r for r in rows) else "actor/clip_frac"
    masked = _finite([r.get(masked_key) for r in rows])
    stale = _finite([r.get("staleness/mean") for r in rows])
    evaluated = [(float(r["eval/step"]), float(r["eval/success"])) for r in rows if "eval/success" in r]
    return RunSummary(
        variant=variant, seed=seed, heldout=heldout, gain=heldout - sft_heldout,
        drawdown=largest_drawdown(smoothed), steps_to_90=steps_to_fraction(steps, smoothed),
        ev_step1=ev_step1, ev_last20=statistics.fmean(finite_evs[-20:]) if finite_evs else None,
        masked=statistics.fmean(masked) if masked else None, staleness=statistics.fmean(stale) if stale else None,
        wall_s=wall_s, eval_sd=eval_sd, steps=steps, reward=reward, eval_steps=[s for s, _ in evaluated],
        eval_success=[v for _, v in evaluated])


# ---- per variant ---------------------------------------------------------------------------------

COLUMNS = (("heldout", "held-out success", "{:.3f}"), ("gain", "gain over SFT", "{:+.3f}"),
           ("drawdown", "largest reward drawdown", "{:.3f}"), ("steps_to_90", "steps to 90% of final", "{:.0f}"),
           ("ev_step1", "critic EV step 1", "{:.2f}"), ("ev_last20", "critic EV (last 20)", "{:.2f}"),
           ("masked", "DIS masked (PPO clipped) frac", "{:.4f}"), ("staleness", "staleness", "{:.2f}"),
           ("wall_s", "wall time (s)", "{:.0f}"))


def mean_sd(values: Sequence[float | int | None]) -> tuple[float | None, float | None, int]:
    """(mean, sd over seeds, count) of the values that exist."""
    present = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not present:
        return None, None, 0
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else 0.0, len(present)


def variant_table(runs: dict[str, list[RunSummary]], labels: dict[str, str]) -> str:
    """Markdown table, one row per variant: mean (sd) over seeds of every column."""
    head = "| variant | seeds | " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for variant, summaries in runs.items():
        cells = []
        for key, _, fmt in COLUMNS:
            mean, sd, n = mean_sd([getattr(s, key) for s in summaries])
            if mean is None:
                cells.append("n/a")
            elif key in ("heldout", "gain"):
                cells.append(f"{fmt.format(mean)} ({sd:.3f})")
            else:
                cells.append(fmt.format(mean) + ("" if n == len(summaries) else f" ({n} of {len(summaries)})"))
        lines.append(f"| {labels.get(variant, variant)} | {len(summaries)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the paper's claims --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Claim:
    text: str
    """What the paper says (with its numbers)."""
    better: str | None = None
    """Variant that should win on held-out success (None: not a comparison the study can make)."""
    worse: str | None = None
    testable_note: str = ""
    """Why it cannot be tested at this size, for claims with no comparison."""


PAPER_CLAIMS: tuple[Claim, ...] = (
    Claim("SAO beats GRPO + DIS (AIME25 97.3 vs 93.5; BeyondAIME 74.8 vs 70.8)", "sao", "grpo_dis"),
    Claim("GRPO + DIS beats GRPO: DIS matters (93.5 vs 84.2)", "grpo_dis", "grpo"),
    Claim("SAO beats GRPO (97.3 vs 84.2)", "sao", "grpo"),
    Claim("K = 2 critic steps per actor step beat K = 1 (97.3 vs 95.0)", "sao", "sao_k1"),
    Claim("A frozen-attention critic beats a full-parameter critic (97.3 vs 90.6)", "sao", "sao_full_critic"),
    Claim("The critic beats a running-mean baseline (97.3 vs 79.8)", "sao", "running_mean"),
    Claim("Value pretraining avoids the critic's cold start (final success)", "sao", "sao_no_value_pretrain"),
    Claim("Single rollout + critic trains stably for ~1000 steps while vanilla GRPO collapses near step 160 "
          "(VAPO near 90)", testable_note="runs here are at most a few hundred steps on a 2-layer model; the "
                                          "table's drawdown column shows how far each variant slid back instead"),
    Claim("SAO on SWE-Bench Verified (29.8 vs GRPO + DIS 27.0, base 23.0) and at 750B-A40B",
          testable_note="no agentic coding task or large model on this box"),
)


def _mean_and_run_variance(summaries: Sequence[RunSummary]) -> tuple[float, float, int]:
    """Mean held-out success over seeds, the variance of one run's (sd over seeds squared, at
    least the evaluation's own), and the number of runs."""
    mean, sd, n = mean_sd([s.heldout for s in summaries])
    if mean is None or sd is None:
        raise ValueError("no held-out success in these runs")
    eval_variances = [s.eval_sd**2 for s in summaries if s.eval_sd is not None]
    floor = statistics.fmean(eval_variances) if eval_variances else 0.0
    return mean, max(sd**2, floor), n


def judge(claim: Claim, runs: dict[str, list[RunSummary]]) -> tuple[str, str]:
    """(verdict, measured) of one claim: reproduced / not reproduced / not testable at this size."""
    if claim.better is None:
        return "not testable at this size", claim.testable_note
    if claim.better not in runs or claim.worse not in runs:
        return "not testable at this size", "variant not run"
    (ma, va, na), (mb, vb, nb) = _mean_and_run_variance(runs[claim.better]), _mean_and_run_variance(runs[claim.worse])
    se = math.sqrt(va / na + vb / nb)
    diff = ma - mb
    measured = f"{ma:.3f} vs {mb:.3f} (difference {diff:+.3f}, 2 x standard error {2 * se:.3f})"
    if diff > 2 * se:
        return "reproduced", measured
    sign = "same sign, within noise" if diff > 0 else "opposite sign" + (", within noise" if -diff <= 2 * se else "")
    return f"not reproduced ({sign})", measured


def claims_table(runs: dict[str, list[RunSummary]], ev_note: str) -> str:
    lines = ["| paper's claim | here | verdict |", "|---|---|---|"]
    for claim in PAPER_CLAIMS:
        verdict, measured = judge(claim, runs)
        if claim.worse == "sao_no_value_pretrain" and ev_note:
            measured = f"{measured}; {ev_note}"
        lines.append(f"| {claim.text} | {measured} | {verdict} |")
    return "\n".join(lines)


def ev_note(runs: dict[str, list[RunSummary]]) -> str:
    """Critic EV at RL step 1 with and without value pretraining."""
    with_vp = mean_sd([s.ev_step1 for s in runs.get("sao", [])])[0]
    without = mean_sd([s.ev_step1 for s in runs.get("sao_no_value_pretrain", [])])[0]
    if with_vp is None or without is None:
        return ""
    return f"critic EV at RL step 1: {with_vp:.2f} with value pretraining, {without:.2f} without"


# ---- figure ---------------------------------------------------------------------------------------


def draw_study(runs: dict[str, list[RunSummary]], labels: dict[str, str], sft_heldout: float, out: Path) -> Path:
    """Two panels: the training reward (moving mean) and the held-out success during training, per
    variant the mean over seeds with a band of +-1 sd."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6))
    for i, (variant, summaries) in enumerate(runs.items()):
        color = plt.get_cmap("tab10")(i % 10)
        label = labels.get(variant, variant)
        for ax, xs, ys, smooth in ((left, "steps", "reward", True), (right, "eval_steps", "eval_success", False)):
            curves = [(getattr(s, xs), moving_mean(getattr(s, ys)) if smooth else getattr(s, ys)) for s in summaries]
            curves = [c for c in curves if c[0]]
            if not curves:
                continue
            n = min(len(x) for x, _ in curves)
            x = np.array(curves[0][0][:n], dtype=float)
            y = np.array([c[1][:n] for c in curves], dtype=float)
            mean, sd = y.mean(axis=0), y.std(axis=0)
            ax.plot(x, mean, color=color, label=label, linewidth=1.6, marker=None if smooth else ".")
            ax.fill_between(x, mean - sd, mean + sd, color=color, alpha=0.15)
    right.axhline(sft_heldout, color="black", linestyle="--", linewidth=1, label="SFT (final evaluation)")
    left.set_title(f"Training reward (moving mean over {SMOOTH} steps), mean +- sd over seeds")
    right.set_title("Held-out success during training, mean +- sd over seeds")
    for ax, ylabel in ((left, "reward"), (right, "success")):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    right.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_study(out_dir: Path, runs: dict[str, list[RunSummary]], labels: dict[str, str], sft_heldout: float,
                num_heldout: int, command: str, setup: str) -> Path:
    """`study.md` (table, figure, claims), `study.png` and `study.json` in `out_dir`."""
    figure = draw_study(runs, labels, sft_heldout, out_dir / "study.png")
    (out_dir / "study.json").write_text(json.dumps(
        {"sft_heldout": sft_heldout, "num_heldout_prompts": num_heldout, "command": command,
         "runs": {v: [asdict(s) for s in ss] for v, ss in runs.items()}}, indent=1) + "\n")
    note = ev_note(runs)
    text = (f"# Ablation study (`sao study`)\n\nCommand: `{command}`\n\n{setup}\n\n"
            f"SFT policy (the common start): held-out success {sft_heldout:.3f} on {num_heldout} prompts.\n\n"
            f"## Table (mean over seeds; held-out success and gain: mean (sd))\n\n{variant_table(runs, labels)}\n\n"
            f"## Figure\n\n![study]({figure.name})\n\n## The paper's claims here\n\n{claims_table(runs, note)}\n")
    page = out_dir / "study.md"
    page.write_text(text)
    return page


def setup_text(rl: Any, seeds: Sequence[int], heldout: int, eval_every: int, eval_prompts: int,
               load_before: Sequence[float], load_after: Sequence[float]) -> str:
    """The page's setup paragraph: what every run of the study shares (`rl`, the SAO stage's
    resolved config), the held-out prompts, and the machine's load over the study."""
    import os

    trajectories = rl.run.total_steps * rl.data.batch_size
    actor = rl.actor.optim
    schedule = "" if actor.lr_decay_style == "constant" else f" ({actor.lr_decay_style} to {actor.min_lr:g})"
    return (f"Every run: {rl.run.total_steps} steps of {rl.data.batch_size} trajectories ({trajectories} sampled "
            f"trajectories; GRPO variants: {rl.data.batch_size // 8} prompts x 8), actor lr {actor.lr:g}{schedule}, "
            f"critic lr {rl.critic.optim.lr:g}, the `{rl.rollout.environment}` task with its difficulty tiers, "
            f"seeds {list(seeds)} (the RL stage's seed: rollouts, data order, initial value head where fresh; the SFT "
            f"and value-pretrained start is the same for all). Held-out prompts: {heldout} (none in the "
            f"training prompts), the first {eval_prompts} evaluated during training every {eval_every} steps, all of "
            f"them for the final policy. Machine: {os.cpu_count()} cores, load average {load_before[0]:.1f} at the "
            f"start and {load_after[0]:.1f} at the end (wall times carry whatever else ran).")
