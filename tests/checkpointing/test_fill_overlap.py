"""The torch_dist save overlapped with the load that fills the model (`FillTracker`, `save_model(fill=...)`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_sao.checkpointing.fill_schedule import FillSchedule
from megatron_sao.checkpointing.fill_tracker import FillTracker
from megatron_sao.platform import run_distributed
from tests.one_process import jobs_in_one_process


def _waiter(tracker: FillTracker, tensor: torch.Tensor, done: list[str]) -> threading.Thread:
    def wait() -> None:
        try:
            tracker.wait(tensor)
            done.append("ready")
        except RuntimeError as error:
            done.append(f"error: {error}")

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def test_a_view_is_ready_when_the_tensor_holding_it_is_marked():
    first, second = torch.zeros(8, 4), torch.zeros(6)
    tracker = FillTracker([second, first])
    half = first[4:]  # like the up half of a gated fc1
    done: list[str] = []
    thread = _waiter(tracker, half, done)
    tracker.mark(second)
    time.sleep(0.1)
    assert done == [], "marking another tensor must not release a view of this one"
    tracker.mark(first)
    thread.join(timeout=5)
    assert done == ["ready"]
    assert tracker.position(half) == 1 and tracker.position(second) == 0
    assert tracker.position(torch.zeros(3)) == 2, "untracked tensors come last"


def test_an_untracked_tensor_waits_for_finish_and_a_failure_releases_every_waiter():
    tracked, untracked = torch.zeros(4), torch.zeros(4)
    tracker = FillTracker([tracked])
    done: list[str] = []
    thread = _waiter(tracker, untracked, done)
    time.sleep(0.1)
    assert done == []
    tracker.finish()
    thread.join(timeout=5)
    assert done == ["ready"]

    failing = FillTracker([tracked])
    done.clear()
    threads = [_waiter(failing, t, done) for t in (tracked, untracked)]
    failing.fail(ValueError("row 3 is broken"))
    for t in threads:
        t.join(timeout=5)
    assert done == ["error: the conversion filling this checkpoint failed: row 3 is broken"] * 2


def test_tracked_tensors_may_not_overlap():
    base = torch.zeros(10)
    with pytest.raises(AssertionError, match="overlap"):
        FillTracker([base[:6], base[4:]])


def _filled(i: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) + i


def _overlapped_save(directory: str, fail_after: int | None, fastio: bool = False) -> dict[str, Any]:
    """Rank job: four tensors saved while a `fill` fills them one by one."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_sao.checkpointing.dist_writer import BoundedSaveStrategy

    tensors = [torch.full((256, 1024), float("nan")) for _ in range(4)]
    tracker = FillTracker(tensors)
    written = [0]
    written_before_fill_ended = [0]
    lock = threading.Lock()

    def on_bytes(n: int) -> None:
        with lock:
            written[0] += n

    def fill() -> None:
        for i, tensor in enumerate(tensors):
            if fail_after is not None and i == fail_after:
                raise ValueError(f"tensor {i} cannot be converted")
            tensor.copy_(_filled(i, tensor.shape))
            tracker.mark(tensor)
            if i == 1:  # the first two are ready: a writer must write them while fill goes on
                deadline = time.monotonic() + 30
                while written[0] < 2 * tensors[0].nbytes and time.monotonic() < deadline:
                    time.sleep(0.01)
        written_before_fill_ended[0] = written[0]
        tracker.finish()

    Path(directory).mkdir()
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t) for i, t in enumerate(tensors)}
    strategy = BoundedSaveStrategy(thread_count=2, bucket_bytes=2**20, on_bytes=on_bytes, fill=fill, tracker=tracker,
                                   fastio=fastio)
    try:
        dist_checkpointing.save(state, directory, sharded_strategy=strategy)
    except ValueError as error:
        return {"error": str(error), "threads": [t.name for t in threading.enumerate() if "sao-torch" in t.name]}
    fresh = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros(256, 1024)) for i in range(4)}
    loaded = dist_checkpointing.load(fresh, directory)
    return {"written_before_fill_ended": written_before_fill_ended[0], "tensor_bytes": tensors[0].nbytes,
            "exact": all(torch.equal(loaded[f"t{i}"], _filled(i, (256, 1024))) for i in range(4)),
            "zeros_left": [int((t == 0).sum()) for t in tensors], "released_bytes": strategy.released_bytes}


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The three saves in one spawned process (tests/one_process.py): the standard path, then the
    failing fill (no writer thread of either save may be left), then fast I/O (last: it imports
    `checkpointing.fastio`)."""
    root = tmp_path_factory.mktemp("fill_overlap")
    jobs = {"standard": (_overlapped_save, (str(root / "standard"), None)),
            "failing": (_overlapped_save, (str(root / "failing"), 2)),
            "fastio": (_overlapped_save, (str(root / "fastio"), None, True))}
    return run_distributed(jobs_in_one_process, 1, jobs, timeout_s=600)[0]


def test_the_save_writes_filled_tensors_while_fill_runs_and_the_result_is_exact(saves):
    result = saves["standard"]
    assert result["exact"]
    assert result["written_before_fill_ended"] >= 2 * result["tensor_bytes"]
    # the standard path gives nothing back (tensor 0 holds one zero of its own: arange)
    assert result["released_bytes"] == 0 and result["zeros_left"] == [1, 0, 0, 0]


def test_fastio_gives_each_tensor_back_once_saved_and_the_checkpoint_stays_exact(saves):
    result = saves["fastio"]
    assert result["exact"], "the files hold what was filled, though the tensors were released after writing"
    elements = result["tensor_bytes"] // 4
    page_elements = 4096 // 4
    # only whole pages inside each tensor go back (they read as zeros): at most a page lost at each end
    assert all(elements - 2 * page_elements <= zeros <= elements for zeros in result["zeros_left"])
    assert result["released_bytes"] >= 4 * (result["tensor_bytes"] - 2 * 4096)


def test_a_failing_fill_fails_the_save_and_stops_its_writers(saves):
    result = saves["failing"]
    assert result["error"] == "tensor 2 cannot be converted"
    assert result["threads"] == []


def _task(target: torch.Tensor | None) -> SimpleNamespace:
    return SimpleNamespace(megatron_module=None if target is None else object(), param_weight=target)


def test_fill_schedule_fills_before_the_first_task_and_marks_after_the_last():
    a, b, buffer = torch.zeros(1000), torch.zeros(3, 5), torch.zeros(2)
    tracker = FillTracker([a, b, buffer])
    schedule = FillSchedule({"a": a, "b": b, "buffer": buffer}, late=set(), tracker=tracker)
    tasks = [_task(a), _task(None), _task(b), _task(a)]  # a is written by two tasks (like a fused QKV)
    writes = {id(a): [lambda: a[:500].fill_(1.0), lambda: a[500:].fill_(2.0)],
              id(b): [lambda: b[:2].fill_(3.0)]}  # leaves b's last row unwritten
    schedule.plan(tasks)
    assert torch.isnan(buffer).all(), "a tensor no task writes is filled up front"
    all_nan_at_first_task = {}
    for task in schedule.run(tasks):
        if task.param_weight is None:
            continue
        key = id(task.param_weight)
        all_nan_at_first_task.setdefault(key, bool(torch.isnan(task.param_weight).all()))
        writes[key].pop(0)()
    assert all_nan_at_first_task == {id(a): True, id(b): True}
    done: list[str] = []
    _waiter(tracker, a, done).join(timeout=5)
    assert done == ["ready"], "a is marked once its last task ran"
    waiting: list[str] = []
    thread = _waiter(tracker, b, waiting)
    time.sleep(0.1)
    assert waiting == [], "b still holds NaN: it must not be marked (the writer would save it)"
    assert schedule.unwritten() == ["b", "buffer"]
    tracker.finish()
    thread.join(timeout=5)


def test_fill_schedule_stops_its_threads_when_the_task_loop_fails():
    a = torch.zeros(10)
    schedule = FillSchedule({"a": a}, late=set(), tracker=FillTracker([a]))
    schedule.plan([_task(a)])
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="bridge failed"):
        for _ in schedule.run([_task(a)]):
            raise ValueError("bridge failed")
    time.sleep(0.05)
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("sao-nan-")]


def test_the_fill_runs_at_most_its_bound_ahead_of_the_task_loop():
    """The NaN fill is the first touch of the shard: bounded, it fills the pages the writer just
    gave back instead of running through the whole shard first."""
    from megatron_sao.checkpointing.fill_schedule import _FillAhead

    tensors = [torch.zeros(256) for _ in range(8)]  # 1 KiB each
    fill = _FillAhead(tensors, max_ahead_bytes=2 * 1024)
    fill.start()
    try:
        fill.wait_filled(0)
        time.sleep(0.2)  # room for the fill to run on, were it unbounded
        assert [bool(torch.isnan(t).all()) for t in tensors] == [True] * 3 + [False] * 5  # 0, then 2 KiB past it
        fill.wait_filled(4)
        time.sleep(0.2)
        assert [bool(torch.isnan(t).all()) for t in tensors] == [True] * 7 + [False]
        fill.wait_filled(7)
    finally:
        fill.stop()
    assert all(torch.isnan(t).all() for t in tensors)


def test_a_fill_held_back_by_its_bound_stops():
    from megatron_sao.checkpointing.fill_schedule import _FillAhead

    fill = _FillAhead([torch.zeros(256) for _ in range(4)], max_ahead_bytes=1)
    fill.start()
    time.sleep(0.05)
    fill.stop()  # returns: the waiting fill thread is woken and ends
    assert not [t for t in threading.enumerate() if t.name == "sao-nan-fill"]
