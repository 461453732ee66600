"""One progress line per conversion: bytes read and written so far, rate, time left (rank 0, stderr).

A conversion reads its input and writes its output, and both take time (the torch_dist save of a
1.5 TB model is half of it), so the line counts the bytes of every phase against the total of all
of them: `total` is what rank 0 reads plus what it writes, and the current phase is named (read,
write, ...). Tensor counts say little when tensor sizes span six orders of magnitude; bytes are
what the disk sees. Writer threads call `advance` concurrently. Non-zero ranks and
`enabled=False` print nothing. Updates are throttled to a few per second.
"""

from __future__ import annotations

import threading
import time
from typing import TextIO

from megatron_sao.checkpointing.output_dir import human_bytes
from megatron_sao.utils.console import console_err

_WIDTH = 24


class Progress:
    def __init__(self, label: str, total_bytes: int, enabled: bool = True, stream: TextIO | None = None,
                 min_interval_s: float = 0.25) -> None:
        self.label = label
        self.total_bytes = total_bytes
        self.enabled = enabled
        self.stream = stream if stream is not None else console_err()
        self.min_interval_s = min_interval_s
        self.nbytes = 0
        self.phase = ""
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._lock = threading.Lock()

    def start_phase(self, name: str, total_bytes: int | None = None) -> None:
        """Name the current phase; `total_bytes` replaces the estimate of everything (done + to do)."""
        with self._lock:
            self.phase = name
            if total_bytes is not None:
                self.total_bytes = total_bytes

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.nbytes += nbytes
            now = time.monotonic()
            if self.enabled and now - self._last_draw >= self.min_interval_s:
                self._last_draw = now
                self._draw(now, end="\r")

    def close(self) -> float:
        """Finish the line; returns the elapsed seconds."""
        with self._lock:
            now = time.monotonic()
            if self.enabled:
                self._draw(now, end="\n")
            return now - self._start

    def _draw(self, now: float, end: str) -> None:
        elapsed = max(now - self._start, 1e-9)
        total = max(self.total_bytes, self.nbytes)
        fraction = self.nbytes / total if total else 1.0
        filled = min(_WIDTH, int(fraction * _WIDTH))
        rate = self.nbytes / elapsed
        left = (total - self.nbytes) / rate if rate > 0 else 0.0
        line = (f"{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {fraction:6.1%}  {self.phase:<6} "
                f"{human_bytes(self.nbytes)}/{human_bytes(total)}  {human_bytes(rate)}/s  "
                f"{elapsed:.0f}s elapsed, ~{left:.0f}s left")
        self.stream.write(line + end)
        self.stream.flush()
