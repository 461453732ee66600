"""`page_release`: whole pages inside a tensor go back to the OS; the bytes around them stay."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from megatron_sao.checkpointing.fastio.page_release import releasable_range, release_pages, release_tensor

PAGE = mmap.PAGESIZE


def test_releasable_range_keeps_to_whole_pages_inside_the_bytes():
    assert releasable_range(0, 3 * PAGE) == (0, 3 * PAGE)
    assert releasable_range(1, 3 * PAGE) == (PAGE, 2 * PAGE)
    assert releasable_range(PAGE - 1, PAGE + 2) == (PAGE, PAGE)
    assert releasable_range(10, PAGE) == (PAGE, 0)
    assert releasable_range(PAGE + 1, 10) == (2 * PAGE, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_a_released_view_reads_zeros_on_its_whole_pages_and_keeps_its_neighbours_bytes():
    base = torch.arange(1, 6 * PAGE // 4 + 1, dtype=torch.float32)  # 6 pages of non-zero values
    view = base[100:-100]  # starts and ends mid-page
    released = release_tensor(view)
    start, length = releasable_range(view.data_ptr(), view.numel() * 4)
    assert released == length >= 3 * PAGE
    first = (start - base.data_ptr()) // 4
    last = first + length // 4
    assert torch.count_nonzero(base[first:last]) == 0
    assert torch.equal(base[:first], torch.arange(1, first + 1, dtype=torch.float32))
    assert torch.equal(base[last:], torch.arange(last + 1, base.numel() + 1, dtype=torch.float32))
    base[first:last] = 7.0  # the memory is still the tensor's: writable, and keeps what is written
    assert torch.all(base[first:last] == 7.0)


def test_nothing_to_release_is_not_an_error():
    assert release_pages(PAGE + 1, 100) == 0
    with pytest.raises(AssertionError, match="contiguous"):
        release_tensor(torch.zeros(4, 4).t())
