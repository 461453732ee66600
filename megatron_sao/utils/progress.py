"""Live progress of a training stage, from the driver process: step / total, reward, success,
critic EV, staleness, tokens/s and ETA.

The trainer ranks (local processes, Ray actors) write one row per step to `<run_dir>/metrics.jsonl`;
`StageProgress` follows that file from the process that launched them, so it works the same for
every launch path and whatever the ranks' own output does (`sao demo` sends it to a log file). On a
terminal the line is redrawn in place (carriage return, erase to end of line) at every new step and
ends with a newline when the stage does; in a log file or a pipe it prints a plain line at the
first step, every `logging.progress_interval_s` seconds and at the end:

    [sao] step 37/150 | reward 0.846 | success 0.781 | EV 0.42 | stale 1.3 | 2.1k tok/s | eval 0.62 | ETA 2m05s

A field whose metric the stage does not log is left out (SFT shows its loss instead of a reward;
EV shows `n/a` on steps where it is not reported). ETA is the remaining steps at the rate of
the steps seen so far in this process (a resumed run starts the clock at its first new step).
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, TextIO

CLEAR_LINE = "\r\x1b[K"


def _num(row: dict[str, Any], key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def format_rate(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def format_progress(stage: str, step: int, total: int, row: dict[str, Any], eval_success: float | None = None,
                    eta_s: float | None = None) -> str:
    """One progress line for `row` (the latest metrics row of the stage)."""
    parts = [f"[{stage}] step {step}/{total}"]
    reward, success = _num(row, "train/reward_mean"), _num(row, "train/success_rate")
    if reward is not None:
        parts.append(f"reward {reward:.3f}")
    if success is not None:
        parts.append(f"success {success:.3f}")
    if reward is None and (loss := _num(row, "actor/loss")) is not None:
        parts.append(f"loss {loss:.4g}")
    if "critic/explained_variance" in row or "critic/value_loss" in row:
        ev = _num(row, "critic/explained_variance")
        parts.append(f"EV {ev:.2f}" if ev is not None and math.isfinite(ev) else "EV n/a")
    if (stale := _num(row, "staleness/mean")) is not None:
        parts.append(f"stale {stale:.1f}")
    if (rate := _num(row, "perf/tokens_per_s")) is not None:
        parts.append(f"{format_rate(rate)} tok/s")
    if eval_success is not None:
        parts.append(f"eval {eval_success:.3f}")
    parts.append(f"ETA {format_duration(eta_s)}" if eta_s is not None else "ETA --")
    return " | ".join(parts)


class StageProgress:
    """Follow `metrics_path` (rows `{"step": N, ...}`) and show the stage's progress on `stream`.
    Use as a context manager (a thread polls every `poll_s`), or call `poll()` / `close()`."""

    def __init__(self, stage: str, metrics_path: Path, total_steps: int, stream: TextIO, *,
                 interval_s: float = 30.0, poll_s: float = 1.0, tty: bool | None = None,
                 clock: Any = time.monotonic) -> None:
        self.stage = stage
        self.path = Path(metrics_path)
        self.total = total_steps
        self.stream = stream
        self.interval_s = interval_s
        self.poll_s = poll_s
        self.tty = stream.isatty() if tty is None else tty
        self.clock = clock
        self._offset = 0
        self._partial = ""
        self._row: dict[str, Any] | None = None
        self._eval: float | None = None
        self._first: tuple[int, float] | None = None  # (step, time) of the first row seen
        self._last_print = -math.inf
        self._shown: str | None = None
        self._dirty = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- reading -----------------------------------------------------------------------------

    def skip_existing(self) -> None:
        """Start after the rows already in the file (an earlier attempt's; a resume rewrites it)."""
        try:
            self._offset = self.path.stat().st_size
        except FileNotFoundError:
            self._offset = 0

    def _read_rows(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:  # rewritten (a resume truncates the rows after its checkpoint)
            self._offset, self._partial = 0, ""
        with self.path.open("r", encoding="utf-8", errors="replace") as f:
            f.seek(self._offset)
            text = self._partial + f.read()
            self._offset = f.tell()
        lines = text.split("\n")
        self._partial = lines.pop()  # a row still being written
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
        return rows

    def poll(self) -> None:
        """Read new rows and show the line if it is due."""
        with self._lock:
            now = self.clock()
            for row in self._read_rows():
                self._row = row
                self._dirty = True
                if self._first is None:
                    self._first = (row["step"], now)
                if (ev := _num(row, "eval/success")) is not None:
                    self._eval = ev
            if self._row is None:
                return
            if self._dirty and (self.tty or now - self._last_print >= self.interval_s):
                self._show(now)

    def line(self, now: float | None = None) -> str | None:
        """The current progress line (None before the first row)."""
        if self._row is None:
            return None
        now = self.clock() if now is None else now
        step = self._row["step"]
        eta = None
        if self._first is not None and step > self._first[0] and now > self._first[1]:
            rate = (step - self._first[0]) / (now - self._first[1])
            eta = max(self.total - step, 0) / rate
        if step >= self.total:
            eta = 0.0
        return format_progress(self.stage, step, self.total, self._row, self._eval, eta)

    def _show(self, now: float) -> None:
        text = self.line(now)
        if text is None:
            return
        if self.tty:
            self.stream.write(CLEAR_LINE + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._shown, self._dirty, self._last_print = text, False, now

    # ---- lifecycle ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except OSError:  # the terminal went away: progress is a courtesy, never a failure
                return

    def __enter__(self) -> StageProgress:
        self._thread = threading.Thread(target=self._run, name=f"progress-{self.stage}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop following; show the last line (on a terminal, ending the in-place line)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.poll()
            with self._lock:
                text = self.line()
                if text is None:
                    return
                if self.tty:
                    self.stream.write(CLEAR_LINE + text + "\n")
                elif text != self._shown:
                    self.stream.write(text + "\n")
                self.stream.flush()
        except OSError:
            pass

    def __exit__(self, *exc: object) -> None:
        self.close()


def stage_progress(config: Any, run_dir: Path, stage: str | None = None) -> Any:
    """A `StageProgress` of the run at `run_dir` on the command's own output (`console_out()`:
    the terminal even when third-party output goes to a log file), or a no-op context when
    `logging.progress_interval_s` is 0. Rows already in the file are not shown again."""
    import contextlib

    from megatron_sao.utils.console import console_out

    interval = config.logging.progress_interval_s
    if interval <= 0:
        return contextlib.nullcontext()
    progress = StageProgress(stage or config.run.name, Path(run_dir) / "metrics.jsonl", config.run.total_steps,
                             console_out(), interval_s=interval)
    progress.skip_existing()
    return progress
