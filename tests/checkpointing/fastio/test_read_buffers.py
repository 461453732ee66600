"""read_buffers: a buffer comes back only when nothing views it, and the pool stays in its budget."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from megatron_sao.checkpointing.fastio.read_buffers import ReadBuffers

PAGE = mmap.PAGESIZE


def test_a_buffer_serves_the_next_read_of_its_size_once_its_last_view_is_gone():
    pool = ReadBuffers(64 * PAGE)
    first = pool.tensor(PAGE + 100)
    assert first.numel() == PAGE + 100 and first.data_ptr() % PAGE == 0
    first.fill_(7)
    address = first.data_ptr()
    view = first[10:20].view(torch.int16)
    del first
    gc.collect()
    second = pool.tensor(PAGE + 100)  # the view still holds the first buffer
    assert second.data_ptr() != address and pool.reused == 0
    del view
    gc.collect()
    third = pool.tensor(2 * PAGE)  # same page-rounded size
    assert third.data_ptr() == address and pool.reused == 1
    assert int(third[0]) == 7  # handed out as it was: the caller overwrites it
    assert pool.idle_bytes() == 0


def test_idle_buffers_stay_within_the_budget_and_larger_ones_are_never_kept():
    pool = ReadBuffers(3 * PAGE)
    small = [pool.tensor(PAGE) for _ in range(3)]
    large = pool.tensor(4 * PAGE)  # over the budget alone: handed out, not kept
    del small, large
    gc.collect()
    assert pool.idle_bytes() == 3 * PAGE
    pool.tensor(4 * PAGE)
    assert pool.reused == 0
    two = pool.tensor(2 * PAGE)  # no idle buffer of its size: a new one, and the oldest idle make room
    del two
    gc.collect()
    assert pool.idle_bytes() <= 3 * PAGE


def test_a_budget_of_nothing_is_refused():
    with pytest.raises(ValueError, match="budget > 0"):
        ReadBuffers(0)


def test_a_buffer_freed_while_the_pool_is_busy_comes_back_later_without_blocking():
    """A tensor in a reference cycle dies in whatever garbage collection runs next, possibly one
    the pool sets off while holding its lock: taking the buffer back must not wait for that lock."""
    import threading

    pool = ReadBuffers(64 * PAGE)

    class Holder:
        pass

    holder = Holder()
    holder.self, holder.tensor = holder, pool.tensor(PAGE)
    address = holder.tensor.data_ptr()
    del holder
    with pool._lock:  # the pool mid-call
        collector = threading.Thread(target=gc.collect, daemon=True)
        collector.start()
        collector.join(timeout=30)
        assert not collector.is_alive(), "the buffer's finalizer waited for the pool's lock"
    assert pool.idle_bytes() == PAGE
    assert pool.tensor(PAGE).data_ptr() == address and pool.reused == 1
