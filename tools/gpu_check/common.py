"""What the three checks of tools/gpu_check.sh share: the repository on sys.path, the output
folder, the one result line per check, and how to start a Python subprocess the same way this
one was started (under the H200 simulation in the dry run: h200_sim.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIM_ENV = "SAO_H200_SIM"
"""Set by h200_sim.py to the wheel folder it simulates the H200 with; inherited by subprocesses."""


def out_dir() -> Path:
    """Where figures and logs go: $GPU_CHECK_OUT (tools/gpu_check.sh sets it to the device tool's
    $OUT when there is one), else gpu_check_out/ in the repository."""
    path = Path(os.environ.get("GPU_CHECK_OUT") or ROOT / "gpu_check_out")
    path.mkdir(parents=True, exist_ok=True)
    return path


def python_cmd() -> list[str]:
    """argv prefix for a Python subprocess: plain, or through h200_sim.py when simulating."""
    wheels = os.environ.get(SIM_ENV)
    return [sys.executable, str(Path(__file__).with_name("h200_sim.py")), wheels] if wheels else [sys.executable]


def report(name: str, label: str, ok: bool, line: str, figures: dict[str, Any], dry: bool = False) -> int:
    """Print the check's one result line (`gpu_check (a) sao_step: PASS ...`) and write its figures
    to <out>/<name>.json; returns the exit code."""
    head = f"{label} {name}{' [dry run: CPU]' if dry else ''}"
    figures = {"check": head, "ok": ok, "line": line, "time": time.strftime("%Y-%m-%d %H:%M:%S"), **figures}
    (out_dir() / f"{name}.json").write_text(json.dumps(figures, indent=2, default=str))
    print(f"gpu_check {head}: {'PASS' if ok else 'FAIL'} {line}", flush=True)
    return 0 if ok else 1


def quiet_libraries() -> None:
    """Keep Megatron's and megatron-bridge's per-bucket and per-plugin chatter out of the log."""
    import logging
    import warnings

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("megatron.core", "megatron.bridge", "modelopt", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def gib(n: float) -> float:
    return n / 2**30
