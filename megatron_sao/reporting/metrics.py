"""Reading a run's `metrics.jsonl` (one JSON object per line with `step`, as MetricsLogger writes it).

Shared by `sao report` and `tools/plot_metrics.py`. Missing, null, non-numeric and non-finite
values are left out of a series rather than read as zeros, so a gap shows as a gap. A resumed run
may log a step twice; the later line wins (it is the one that continued).
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

logger = logging.getLogger(__name__)


def read_metrics(path: Path) -> dict[int, dict]:
    """`{step: metrics}` from a metrics.jsonl, sorted by step; a repeated step keeps its last line.
    A last line without its newline that does not parse is a line being written (a running run) or
    cut by a kill: skipped with a warning. Any other bad line, or bytes that are not UTF-8, is a
    ValueError naming the file and line."""
    rows: dict[int, dict] = {}
    lines = Path(path).read_bytes().split(b"\n")
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {e.start} of the line)") from e
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError) as e:
            if lineno == len(lines):  # no newline after it: still being written, or cut by a kill
                logger.warning("%s:%d: skipping the last line, cut short (a running or killed run): %s", path,
                               lineno, line[:80])
                continue
            raise ValueError(f"{path}:{lineno}: not a metrics line with a 'step': {e}") from e
        rows[step] = row
    return dict(sorted(rows.items()))


def is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def series(rows: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, leaving out steps where it is missing or not a finite number."""
    steps, values = [], []
    for step, row in rows.items():
        value = row.get(key)
        if is_number(value):
            steps.append(step)
            values.append(float(value))
    return steps, values


def logged_keys(rows: dict[int, dict]) -> set[str]:
    """Keys with at least one finite number."""
    return {k for row in rows.values() for k, v in row.items() if k != "step" and is_number(v)}


def natural_order(key: str) -> list[object]:
    """Sort key that puts `frac_2` before `frac_10` (digit runs compare as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def run_name(metrics_path: Path) -> str:
    """`run.name` of the `config.yaml` beside the metrics, else the directory's name."""
    config = Path(metrics_path).parent / "config.yaml"
    if config.is_file():
        import yaml

        name = ((yaml.safe_load(config.read_text()) or {}).get("run") or {}).get("name")
        if name:
            return str(name)
    return Path(metrics_path).parent.resolve().name
