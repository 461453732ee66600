"""The calibration PNG of a value-pretraining run: predicted vs empirical return by bin (with the
token count per bin), and held-out / training explained variance over steps."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _series(metrics_path: Path, key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    if not metrics_path.is_file():
        return steps, values
    for line in metrics_path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            steps.append(int(row["step"]))
            values.append(float(value))
    return steps, values


def plot_calibration(calibration_json: Path, metrics_jsonl: Path, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(Path(calibration_json).read_text())
    bins = [b for b in result["bins"] if b["count"]]
    fig, (ax_cal, ax_ev) = plt.subplots(1, 2, figsize=(11, 4.2))
    lo, hi = result["bins"][0]["lo"], result["bins"][-1]["hi"]
    ax_cal.plot([lo, hi], [lo, hi], color="grey", linestyle="--", linewidth=1, label="calibrated")
    ax_cal.plot([b["mean_value"] for b in bins], [b["mean_return"] for b in bins], marker="o", label="critic")
    ax_cal.set_xlabel("mean predicted value (bin)")
    ax_cal.set_ylabel("mean empirical return (bin)")
    ev = result["explained_variance"]
    ev_text = f"{ev:.3f}" if ev is not None else "undefined"
    ax_cal.set_title(f"held-out calibration, step {result['step']} (EV {ev_text})")
    counts = ax_cal.twinx()
    counts.bar([(b["lo"] + b["hi"]) / 2 for b in result["bins"]], [b["count"] for b in result["bins"]],
               width=(hi - lo) / max(len(result["bins"]), 1) * 0.9, alpha=0.15, color="tab:blue")
    counts.set_ylabel("action tokens per bin")
    ax_cal.legend(loc="upper left")
    for key, label in (("eval/explained_variance", "held-out"), ("critic/explained_variance", "train batch")):
        steps, values = _series(Path(metrics_jsonl), key)
        if steps:
            ax_ev.plot(steps, values, marker="o" if key.startswith("eval") else None, label=label)
    ax_ev.axhline(0.0, color="grey", linewidth=0.8)
    ax_ev.set_xlabel("step")
    ax_ev.set_ylabel("explained variance")
    ax_ev.set_title("critic explained variance")
    ax_ev.legend(loc="lower right")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
