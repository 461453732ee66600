"""`LoadWindow`: a background load held at most a window ahead of the consumer, never deadlocked."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_sao.checkpointing.fastio.load_window import LoadWindow


def _admit_in_thread(window: LoadWindow, nbytes: int, done: list[int]) -> threading.Thread:
    thread = threading.Thread(target=lambda: (window.admit(nbytes), done.append(nbytes)), daemon=True)
    thread.start()
    return thread


def test_a_reader_waits_for_room_and_goes_on_once_bytes_are_given_back():
    window = LoadWindow(100)
    window.admit(60)
    window.admit(40)  # exactly full
    done: list[int] = []
    thread = _admit_in_thread(window, 30, done)
    time.sleep(0.1)
    assert done == [] and window.held_back == 1
    window.given_back(20)
    time.sleep(0.1)
    assert done == [], "80 + 30 is still over the window"
    window.given_back(60)
    thread.join(timeout=5)
    assert done == [30]


def test_a_waiting_consumer_lets_every_reader_through():
    window = LoadWindow(10)
    window.admit(10)
    done: list[int] = []
    thread = _admit_in_thread(window, 5, done)
    time.sleep(0.1)
    assert done == []
    with window.consumer_waiting():  # it needs something not loaded yet: holding the load back would deadlock
        thread.join(timeout=5)
        assert done == [5]
    late = _admit_in_thread(window, 5, done)
    time.sleep(0.1)
    assert done == [5], "outside the consumer's wait the window holds again"
    window.close()
    late.join(timeout=5)
    assert done == [5, 5]


def test_an_item_larger_than_the_window_is_admitted_when_nothing_is_outstanding():
    window = LoadWindow(10)
    window.admit(1000)
    window.given_back(1000)
    window.admit(1000)
    assert window.held_back == 0


def test_close_releases_a_held_reader_and_a_bad_capacity_is_refused():
    window = LoadWindow(1)
    window.admit(1)
    done: list[int] = []
    thread = _admit_in_thread(window, 1, done)
    window.close()
    thread.join(timeout=5)
    assert done == [1]
    with pytest.raises(ValueError, match="load window"):
        LoadWindow(0)
