"""`sao report RUN_A RUN_B ...`: runs side by side (the online-mode comparison, ablations).

One overlay figure per metric of `COMPARED_KEYS` that any run logged (each run one line, smoothed
by a trailing mean of `smooth` steps, vertical lines at phase boundaries when given) and a table
of how fast each run adapts after each shift: mean reward over the first `window` steps of each
phase and over its last `window` steps, and the steps until the smoothed reward first reaches 90%
of that phase's final level (`recovery`). Written as PNG files and `index.html` into `out_dir`.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

from megatron_sao.reporting.metrics import read_metrics, series
from megatron_sao.reporting.report import CSS, PAGE_NAME
from megatron_sao.utils.atomic import atomic_write_text

COMPARED_KEYS = ("train/reward_mean", "train/success_rate", "critic/explained_variance")


@dataclass(slots=True)
class PhaseStats:
    start_step: int
    early: float
    """Mean reward over the phase's first `window` steps."""
    late: float
    """Mean reward over its last `window` steps."""
    recovery_steps: int | None
    """Steps from the phase's start until the smoothed reward reaches 90% of `late` (None: never)."""


@dataclass(slots=True)
class Comparison:
    page: Path
    figures: list[Path] = field(default_factory=list)
    phases: dict[str, list[PhaseStats]] = field(default_factory=dict)


def _smoothed(values: list[float], smooth: int) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - smooth + 1): i + 1]
        out.append(sum(window) / len(window))
    return out


def phase_stats(steps: list[int], rewards: list[float], phase_steps: int, window: int = 5,
                smooth: int = 5) -> list[PhaseStats]:
    """Adaptation per phase of `phase_steps` steps (phase k covers steps k*phase_steps+1 ..)."""
    smoothed = dict(zip(steps, _smoothed(rewards, smooth), strict=True))
    by_step = dict(zip(steps, rewards, strict=True))
    stats = []
    for start in range(1, (max(steps) if steps else 0) + 1, phase_steps):
        inside = [s for s in steps if start <= s < start + phase_steps]
        if not inside:
            continue
        early = [by_step[s] for s in inside[:window]]
        late_values = [by_step[s] for s in inside[-window:]]
        late = sum(late_values) / len(late_values)
        recovery = next((s - start for s in inside if smoothed[s] >= 0.9 * late), None)
        stats.append(PhaseStats(start, sum(early) / len(early), late, recovery))
    return stats


def write_comparison(runs: dict[str, Path], out_dir: Path, phase_steps: int | None = None,
                     smooth: int = 5) -> Comparison:
    """Overlay `runs` ({label: run directory}); ValueError naming a run without metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {}
    for label, run_dir in runs.items():
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            raise ValueError(f"{path}: no such file (run {label!r} is not a `sao train` run directory)")
        rows[label] = read_metrics(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = Comparison(page=out_dir / PAGE_NAME)
    for key in COMPARED_KEYS:
        drawn = {label: curve for label, r in rows.items() if (curve := series(r, key))[0]}
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(7.2, 3.6))
        for label, (steps, values) in drawn.items():
            ax.plot(steps, _smoothed(values, smooth), label=label, linewidth=1.6)
        if phase_steps:
            last = max(max(steps) for steps, _ in drawn.values())
            for boundary in range(phase_steps, last, phase_steps):
                ax.axvline(boundary + 0.5, color="#888", linestyle="--", linewidth=1)
        ax.set_title(f"{key} (trailing mean of {smooth} steps)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        png = out_dir / f"compare_{key.replace('/', '_')}.png"
        fig.savefig(png, dpi=100)
        plt.close(fig)
        result.figures.append(png)
    if phase_steps:
        for label, r in rows.items():
            result.phases[label] = phase_stats(*series(r, "train/reward_mean"), phase_steps, smooth=smooth)
    atomic_write_text(result.page, _page(runs, result, phase_steps), durable=False)  # rebuilt at will
    return result


def _page(runs: dict[str, Path], result: Comparison, phase_steps: int | None) -> str:
    listed = "".join(f"<li><b>{html.escape(label)}</b>: {html.escape(str(Path(d).resolve()))}</li>"
                     for label, d in runs.items())
    figures = "".join(f'<figure><img src="{html.escape(p.name)}" alt="{html.escape(p.stem)}" width="720" '
                      f'height="360"><figcaption>{html.escape(p.stem)}</figcaption></figure>' for p in result.figures)
    table = ""
    if result.phases:
        head = ("<tr><th>run</th><th>phase</th><th>from step</th><th>reward, first steps</th>"
                "<th>reward, last steps</th><th>steps to 90% of last</th></tr>")
        body = "".join(
            f"<tr><td>{html.escape(label)}</td><td class=num>{i}</td><td class=num>{s.start_step}</td>"
            f"<td class=num>{s.early:.3f}</td><td class=num>{s.late:.3f}</td>"
            f"<td class=num>{'never' if s.recovery_steps is None else s.recovery_steps}</td></tr>"
            for label, stats in result.phases.items() for i, s in enumerate(stats))
        table = f"<h2>Adaptation per phase ({phase_steps} steps each)</h2><table>{head}{body}</table>"
    return (f"<!doctype html>\n<html lang=en><head><meta charset=utf-8><title>Run comparison</title>"
            f"<style>{CSS}</style></head>\n<body><h1>Run comparison</h1><ul>{listed}</ul>{table}"
            f"<h2>Curves</h2><div class=grid>{figures or '<p>No common metric to draw.</p>'}</div></body></html>\n")
