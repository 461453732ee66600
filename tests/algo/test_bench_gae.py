"""`tools/bench_gae.py` runs end to end on a tiny batch and reports agreement with the loop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_runs_and_reports() -> None:
    cmd = [sys.executable, str(ROOT / "tools" / "bench_gae.py"), "--device", "cpu", "--batch", "3", "--tokens", "300",
           "--turns", "4", "--repeats", "1", "--dtype", "float32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for needle in ("memory pass", "tokens/s", "fast / memory pass", "speed-up fast vs loop", "advantages", "OK"):
        assert needle in done.stdout, done.stdout
