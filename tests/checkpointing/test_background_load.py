"""A torch_dist load that goes on in the background while its caller reads what is already loaded
(`dist_reader.CountingLoadStrategy` with a `FillTracker`: mcore-to-hf exports while it loads)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_sao.checkpointing.fill_tracker import FillTracker
from megatron_sao.platform import run_distributed

_SHAPE = (64, 256)


def _expected(i: int) -> torch.Tensor:
    return torch.arange(_SHAPE[0] * _SHAPE[1], dtype=torch.float32).reshape(_SHAPE) * (i + 1)


def _load_in_background(directory: str, track_all: bool, fail_at_item: int | None) -> dict[str, Any]:
    """Rank job: save four tensors and an object, then load them into fresh tensors with a tracker
    (the load fails as it copies item `fail_at_item`, when given)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from megatron_sao.checkpointing.dist_reader import CountingLoadStrategy

    Path(directory).mkdir()
    saved = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", _expected(i)) for i in range(4)}
    saved["obj"] = ShardedObject("obj", {"answer": 42}, (1,), (0,))
    dist_checkpointing.save(saved, directory)

    targets = [torch.full(_SHAPE, float("nan")) for _ in range(4)]
    untracked = torch.full(_SHAPE, float("nan"))
    tracker = FillTracker(targets if track_all else targets[:3])
    if not track_all:
        targets[3] = untracked

    copied = [0]

    def slow_progress(nbytes: int) -> None:  # each item takes 0.3 s: the caller reads while the rest load
        copied[0] += 1
        if copied[0] - 1 == fail_at_item:
            raise OSError(f"item {fail_at_item} cannot be read")
        time.sleep(0.3)

    strategy = CountingLoadStrategy(slow_progress, tracker=tracker)  # torch's FileSystemReader: items in order
    fresh = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t) for i, t in enumerate(targets)}
    fresh["obj"] = ShardedObject("obj", None, (1,), (0,))
    started = time.monotonic()
    loaded = dist_checkpointing.load(fresh, directory, sharded_strategy=strategy)
    returned_after = time.monotonic() - started
    result: dict[str, Any] = {"background": strategy.background is not None, "returned_after": returned_after,
                              "object": loaded["obj"],
                              "in_place": all(loaded[f"t{i}"].data_ptr() == targets[i].data_ptr() for i in range(4))}
    if strategy.background is None:
        result["exact"] = all(torch.equal(targets[i], _expected(i)) for i in range(4))
        return result
    tracker.wait(targets[0])
    result["first_exact_when_released"] = torch.equal(targets[0], _expected(0))
    result["still_loading_then"] = strategy.background.finished_at is None
    for target in targets:
        tracker.wait(target)  # released even when the load fails: collective readers must not hang
    try:
        strategy.background.join()
    except BaseException as error:
        result["error"] = f"{type(error).__name__}: {error}"
        return result
    result["exact"] = all(torch.equal(targets[i], _expected(i)) for i in range(4))
    return result


def _three_loads(directory: str) -> dict[str, dict[str, Any]]:
    """Rank job: the three cases below in one process (one start-up instead of three)."""
    return {"tracked": _load_in_background(f"{directory}/tracked", True, None),
            "untracked": _load_in_background(f"{directory}/untracked", False, None),
            "failing": _load_in_background(f"{directory}/failing", True, 2)}


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return run_distributed(_three_loads, 1, str(tmp_path_factory.mktemp("loads")), timeout_s=300)[0]


def test_the_load_returns_at_once_and_releases_each_tensor_when_it_is_loaded(loads):
    result = loads["tracked"]
    assert result["background"] and result["in_place"]
    assert result["object"] == {"answer": 42}, "objects are loaded before the call returns"
    assert result["returned_after"] < 1.0, "four items at 0.3 s each: the reading went on after the call returned"
    assert result["first_exact_when_released"] and result["still_loading_then"]
    assert result["exact"]


def test_an_untracked_target_loads_in_the_foreground(loads):
    result = loads["untracked"]
    assert not result["background"]
    assert result["returned_after"] >= 4 * 0.3 and result["exact"] and result["object"] == {"answer": 42}


def test_a_failing_background_load_releases_every_waiter_and_join_raises(loads):
    result = loads["failing"]
    assert result["background"]
    assert result["error"].startswith("CheckpointException") and "item 2 cannot be read" in result["error"]
