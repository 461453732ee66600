"""Plot a run's metrics: one subplot per key against `step`, headless (matplotlib Agg).

    python tools/plot_metrics.py runs/tiny_cpu --keys critic/explained_variance actor/loss --out docs/ev.png
    python tools/plot_metrics.py runs/tiny_cpu/metrics.jsonl            # default keys, RUN_DIR/metrics.png

Reads `<run_dir>/metrics.jsonl` (one JSON object per line with `step`, as MetricsLogger writes
it) with `megatron_sao.reporting.metrics`, which `sao report` (every curve of a run, one HTML
page) shares. Missing, null, non-numeric and non-finite values are skipped, not drawn as zeros; a key
with no value at all gets an empty subplot saying so, so a typo is visible rather than silent.
A resumed run may log a step twice; the later line wins (it is the one that continued). The
title is the run name (`run.name` of `<run_dir>/config.yaml`, else the directory's name).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_sao.reporting.metrics import read_metrics, run_name, series

__all__ = ["DEFAULT_KEYS", "main", "plot", "read_metrics", "run_name", "series"]

DEFAULT_KEYS = ("critic/explained_variance", "critic/value_loss", "actor/loss", "actor/entropy")


def plot(metrics_path: Path, keys: list[str], out: Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.4 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        steps, values = series(rows, key)
        if steps:
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, linewidth=1.2)
        else:
            ax.text(0.5, 0.5, f"no values of {key}", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title or run_name(metrics_path))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a run directory or its metrics.jsonl")
    parser.add_argument("--keys", nargs="+", default=list(DEFAULT_KEYS), help=f"default: {' '.join(DEFAULT_KEYS)}")
    parser.add_argument("--out", type=Path, help="PNG to write (default: metrics.png beside metrics.jsonl)")
    parser.add_argument("--title", help="figure title (default: the run name)")
    args = parser.parse_args(argv)
    metrics_path = args.source / "metrics.jsonl" if args.source.is_dir() else args.source
    if not metrics_path.is_file():
        parser.error(f"{metrics_path}: no such file (expected a run directory or a metrics.jsonl)")
    out = args.out or metrics_path.with_name("metrics.png")
    try:
        plot(metrics_path, args.keys, out, args.title)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
