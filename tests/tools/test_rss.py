"""tools/rss.py `measured`: the figures the benchmark and the memory-budget test read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tools.rss import measured

MiB = 2**20


def _touch_fresh(nbytes: int) -> dict:
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    tensor.fill_(1)  # the first touch of every page
    return {"sum": int(tensor[:: 4096].sum())}


def _thp_always() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[always]" in path.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS and page faults read from /proc")
@pytest.mark.skipif(_thp_always(), reason="a huge-page fault maps 2 MB and counts once")
def test_fresh_memory_shows_as_faulted_bytes_and_peak_growth():
    result = measured(_touch_fresh, 64 * MiB)
    assert result["sum"] == 64 * MiB // 4096
    assert result["faulted_bytes"] >= 60 * MiB
    assert result["rss_peak"] - result["rss_start"] >= 60 * MiB
    assert 0 <= result["kernel_cpu_seconds"] <= result["cpu_seconds"]
