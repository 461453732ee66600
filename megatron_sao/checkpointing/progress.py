"""A progress line for conversions: tensors and bytes done, rate, time left (rank 0, stderr).

A 671B conversion runs for an hour or more; a bar that counts only tensors says little when
tensor sizes span six orders of magnitude, so bytes are shown too. Non-zero ranks and
`enabled=False` print nothing. Updates are throttled to a few per second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TextIO

from megatron_sao.checkpointing.console import console_err
from megatron_sao.checkpointing.output_dir import human_bytes


@dataclass(slots=True)
class Progress:
    label: str
    total_tensors: int
    total_bytes: int
    enabled: bool = True
    stream: TextIO = field(default_factory=console_err)
    min_interval_s: float = 0.25
    tensors: int = 0
    nbytes: int = 0
    _start: float = field(default_factory=time.monotonic)
    _last_draw: float = 0.0

    def advance(self, tensors: int = 1, nbytes: int = 0) -> None:
        self.tensors += tensors
        self.nbytes += nbytes
        now = time.monotonic()
        if self.enabled and now - self._last_draw >= self.min_interval_s:
            self._last_draw = now
            self._draw(now, end="\r")

    def close(self) -> float:
        """Finish the line; returns the elapsed seconds."""
        now = time.monotonic()
        if self.enabled:
            self._draw(now, end="\n")
        return now - self._start

    def _draw(self, now: float, end: str) -> None:
        elapsed = max(now - self._start, 1e-9)
        fraction = self.nbytes / self.total_bytes if self.total_bytes else self.tensors / max(self.total_tensors, 1)
        width = 24
        filled = min(width, int(fraction * width))
        rate = self.nbytes / elapsed
        left = (self.total_bytes - self.nbytes) / rate if rate > 0 and self.total_bytes else 0.0
        line = (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {fraction:6.1%}  "
                f"{self.tensors}/{self.total_tensors} tensors  {human_bytes(self.nbytes)}/"
                f"{human_bytes(self.total_bytes)}  {human_bytes(rate)}/s  {elapsed:.0f}s elapsed, ~{left:.0f}s left")
        self.stream.write(line + end)
        self.stream.flush()
