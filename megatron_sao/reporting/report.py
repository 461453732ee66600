"""`sao report RUN_DIR`: a run's curves as PNG files and one self-contained HTML page.

Everything goes to `RUN_DIR/report/` (or `out_dir`): one `<panel>.png` per panel of
`reporting/panels.py` that has data, and `index.html`, which references them by relative path
and needs nothing else (inline CSS, no scripts, no network), so the directory can be copied or
served as is. Panels with no metric logged are listed under "Not logged" instead of drawn empty.
Re-running replaces the page and the panels; a panel PNG left from an earlier report whose
metrics are gone is deleted so that the directory matches the page.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_sao.reporting.metrics import logged_keys, read_metrics, run_name, series
from megatron_sao.reporting.panels import PANELS, Panel, draw_panel
from megatron_sao.utils.atomic import atomic_write_text

PAGE_NAME = "index.html"
SUMMARY_KEYS = ("train/reward_mean", "eval/success", "critic/explained_variance", "train/response_length_mean",
                "actor/dis_masked_low_frac", "actor/dis_masked_high_frac", "staleness/mean", "perf/tokens_per_s")
CSS = """
body { font-family: sans-serif; margin: 24px auto; padding: 0 16px; max-width: 1400px; color: #222; background: #fff; }
h1 { margin-bottom: 4px; } .meta { color: #555; margin-top: 0; }
table { border-collapse: collapse; margin: 8px 0 20px; } td, th { border: 1px solid #ccc; padding: 4px 10px; }
th { background: #f3f3f3; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 18px; }
figure { margin: 0; border: 1px solid #ddd; padding: 8px; } figure img { width: 100%; height: auto; }
figcaption { font-size: 13px; color: #444; } .missing { color: #a33; }
"""


@dataclass(slots=True)
class Report:
    page: Path
    figures: list[Path] = field(default_factory=list)
    not_logged: list[str] = field(default_factory=list)
    """Titles of panels with no metric logged."""


def write_report(run_dir: Path, out_dir: Path | None = None) -> Report:
    """Render `run_dir/metrics.jsonl`; ValueError if the run has none or it is malformed."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        below = sorted(str(m.parent) for m in run_dir.glob("*/metrics.jsonl")) if run_dir.is_dir() else []
        if below:  # e.g. `sao demo`'s runs/tiny_cpu, one run directory per stage
            raise ValueError(f"{run_dir} is not a run directory (no metrics.jsonl) but holds {len(below)}: "
                             f"{', '.join(below)}; report one of them")
        raise ValueError(f"{metrics_path}: no such file (expected the run directory of `sao train`)")
    rows = read_metrics(metrics_path)
    logged = logged_keys(rows)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(page=out_dir / PAGE_NAME)
    sections = []
    for panel in PANELS:
        keys = panel.present_keys(logged)
        png = out_dir / f"{panel.name}.png"
        if not keys:
            png.unlink(missing_ok=True)
            report.not_logged.append(panel.title)
            sections.append((panel, None, []))
            continue
        report.figures.append(draw_panel(panel, rows, keys, png))
        sections.append((panel, png, panel.missing_keys(logged)))
    page = _page(run_name(metrics_path), run_dir, rows, sections)
    atomic_write_text(report.page, page, durable=False)  # a page rebuilt from the run directory at will
    return report


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _summary(rows: dict[int, dict]) -> str:
    lines = []
    for key in SUMMARY_KEYS:
        steps, values = series(rows, key)
        if steps:
            lines.append(f"<tr><td>{html.escape(key)}</td><td class=num>{_fmt(values[0])} (step {steps[0]})</td>"
                         f"<td class=num>{_fmt(values[-1])} (step {steps[-1]})</td>"
                         f"<td class=num>{_fmt(min(values))}</td><td class=num>{_fmt(max(values))}</td></tr>")
    if not lines:
        return "<p>None of the summary metrics is logged.</p>"
    head = "<tr><th>metric</th><th>first</th><th>last</th><th>min</th><th>max</th></tr>"
    return f"<table>{head}{''.join(lines)}</table>"


def _figure(panel: Panel, png: Path, missing: list[str]) -> str:
    note = (f" <span class=missing>Not logged: {html.escape(', '.join(missing))}.</span>" if missing else "")
    return (f'<figure id="{panel.name}"><img src="{html.escape(png.name)}" alt="{html.escape(panel.title)}" '
            f'width="640" height="340"><figcaption><b>{html.escape(panel.title)}.</b> '
            f"{html.escape(panel.caption)}{note}</figcaption></figure>")


def _page(name: str, run_dir: Path, rows: dict[int, dict],
          sections: list[tuple[Panel, Path | None, list[str]]]) -> str:
    steps = list(rows)
    span = f"steps {steps[0]}-{steps[-1]} ({len(steps)} logged)" if steps else "no step logged yet"
    figures = "".join(_figure(p, png, missing) for p, png, missing in sections if png is not None)
    absent = [f"<li><b>{html.escape(p.title)}</b>: not logged ({html.escape(p.describe_keys())})</li>"
              for p, png, _ in sections if png is None]
    absent_html = f"<h2>Not logged</h2><ul>{''.join(absent)}</ul>" if absent else ""
    title = html.escape(f"Run report: {name}")
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    return (f"<!doctype html>\n<html lang=en><head><meta charset=utf-8><title>{title}</title>"
            f"<style>{CSS}</style></head>\n<body><h1>{title}</h1>"
            f"<p class=meta>{html.escape(str(run_dir.resolve()))} &middot; {span} &middot; generated {generated}</p>"
            f"<h2>Summary</h2>{_summary(rows)}<h2>Curves</h2><div class=grid>{figures or '<p>No curve to draw.</p>'}"
            f"</div>{absent_html}</body></html>\n")
