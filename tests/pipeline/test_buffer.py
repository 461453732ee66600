"""The ready buffer: staleness bound and policies, whole groups, distinct prompts, back-pressure,
concurrent producers, checkpoint round trip and the wait-time metric."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from megatron_sao.pipeline.buffer import GROUP_ID_KEY, ReadyBuffer
from megatron_sao.rollout.routing import RoutedExperts
from megatron_sao.rollout.trajectory import FinishType, RewardKind, Trajectory, TrajectoryStatus
from megatron_sao.rollout.trajectory_io import trajectory_to_dict


def _traj(prompt_id: str, versions: list[int] | None = None, status: TrajectoryStatus = TrajectoryStatus.COMPLETED,
          group_id: str | None = None, name: str | None = None) -> Trajectory:
    """A finished trajectory whose action tokens were sampled by `versions` (one token each)."""
    versions = [0] if versions is None else versions
    traj = Trajectory(prompt_id=prompt_id, metadata={GROUP_ID_KEY: group_id} if group_id else {})
    if name:
        traj.trajectory_id = name
    traj.set_prompt([1, 2, 3])
    traj.append_action([7] * len(versions), [-0.5] * len(versions), versions, FinishType.STOP)
    traj.add_reward(1.0, RewardKind.TERMINAL)
    traj.finish(status)
    return traj


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _assert_accounting(buffer: ReadyBuffer) -> None:
    m = buffer.metrics()
    held = m["buffer/num_ready"] + m["buffer/num_pending"]
    assert m["buffer/put"] == m["buffer/taken"] + m["buffer/dropped_stale"] + m["buffer/failed"] + \
        m["buffer/aborted"] + held, m


def _ids(trajs: list[Trajectory] | None) -> list[str]:
    assert trajs is not None
    return [t.trajectory_id for t in trajs]


def test_trajectories_are_ready_at_once_in_order_and_take_times_out_with_none() -> None:
    buffer = ReadyBuffer()
    for i in range(3):
        buffer.put(_traj(f"p{i}", name=f"t{i}"))
    assert buffer.num_ready() == 3
    assert _ids(buffer.take(2, actor_version=0, timeout_s=0.0)) == ["t0", "t1"]
    start = time.monotonic()
    assert buffer.take(2, actor_version=0, timeout_s=0.05) is None  # only one left: nothing taken
    assert 0.04 <= time.monotonic() - start < 2.0
    assert buffer.num_ready() == 1
    _assert_accounting(buffer)


# A, B, C, D at actor version 5 with max_staleness 2; token ages A [2, 2], B [3, 0], C [0], D [4, 4].
# Per token B (oldest token 3) and D exceed the bound; per trajectory (last token) only D does.
STALE_CASES = [("token", {"B", "D"}), ("trajectory", {"D"})]


@pytest.mark.parametrize(("check", "stale"), STALE_CASES)
def test_stale_trajectories_are_dropped_and_counted(check: str, stale: set[str]) -> None:
    buffer = ReadyBuffer(max_staleness=2, staleness_check=check, stale_policy="drop")
    for name, versions in [("A", [3, 3]), ("B", [2, 5]), ("C", [5]), ("D", [1, 1])]:
        buffer.put(_traj(f"p{name}", versions, name=name))
    fresh = [n for n in "ABCD" if n not in stale]
    assert _ids(buffer.take(len(fresh), actor_version=5, timeout_s=0.0)) == fresh
    assert buffer.take(1, actor_version=5, timeout_s=0.01) is None  # the stale ones are gone
    m = buffer.metrics()
    assert m["buffer/dropped_stale"] == len(stale) and m["buffer/kept_stale"] == 0
    # per token nothing beyond the bound is trained on; per trajectory B's old first token is (1 of 5)
    assert m["staleness/token_frac_over"] == pytest.approx(0.0 if check == "token" else 1 / 5)
    _assert_accounting(buffer)


@pytest.mark.parametrize(("check", "stale"), STALE_CASES)
def test_stale_trajectories_are_kept_and_counted(check: str, stale: set[str]) -> None:
    buffer = ReadyBuffer(max_staleness=2, staleness_check=check, stale_policy="keep")
    for name, versions in [("A", [3, 3]), ("B", [2, 5]), ("C", [5]), ("D", [1, 1])]:
        buffer.put(_traj(f"p{name}", versions, name=name))
    assert _ids(buffer.take(4, actor_version=5, timeout_s=0.0)) == ["A", "B", "C", "D"]
    m = buffer.metrics()
    assert m["buffer/kept_stale"] == m["buffer/batch_stale"] == len(stale) and m["buffer/dropped_stale"] == 0
    # token histogram of the batch: ages 2, 2, 3, 0, 0, 4, 4 (7 action tokens)
    assert m["staleness/token_frac_0"] == pytest.approx(2 / 7)
    assert m["staleness/token_frac_1"] == 0.0
    assert m["staleness/token_frac_2"] == pytest.approx(2 / 7)
    assert m["staleness/token_frac_over"] == pytest.approx(3 / 7)
    assert m["staleness/mean"] == pytest.approx(15 / 7) and m["staleness/max"] == 4.0
    _assert_accounting(buffer)


def test_staleness_grows_while_a_trajectory_waits() -> None:
    buffer = ReadyBuffer(max_staleness=1)
    buffer.put(_traj("p0", [0], name="old"))
    assert buffer.take(1, actor_version=2, timeout_s=0.0) is None  # fresh when put, too old when taken
    assert buffer.metrics()["buffer/dropped_stale"] == 1


def test_a_token_newer_than_the_actor_is_a_bookkeeping_error() -> None:
    buffer = ReadyBuffer()
    buffer.put(_traj("p0", [3]))
    with pytest.raises(ValueError, match="newer than the actor's 2"):
        buffer.take(1, actor_version=2, timeout_s=0.0)


def test_groups_are_released_whole() -> None:
    buffer = ReadyBuffer(group_size=3)
    buffer.put(_traj("p0", name="a0"))
    buffer.put(_traj("p1", name="b0"))
    buffer.put(_traj("p0", name="a1"))
    assert buffer.num_ready() == 0 and buffer.metrics()["buffer/num_pending"] == 3
    assert buffer.take(3, actor_version=0, timeout_s=0.01) is None
    buffer.put(_traj("p0", name="a2"))
    assert buffer.num_ready() == 3
    assert _ids(buffer.take(3, actor_version=0, timeout_s=0.0)) == ["a0", "a1", "a2"]
    with pytest.raises(ValueError, match=r"not a multiple of algorithm\.group_size 3"):
        buffer.take(4, actor_version=0)
    _assert_accounting(buffer)


def test_a_failed_member_fills_its_slot_and_the_survivors_are_released() -> None:
    buffer = ReadyBuffer(group_size=3)
    buffer.put(_traj("p0", name="a0"))
    buffer.put(_traj("p0", status=TrajectoryStatus.FAILED))
    buffer.put(_traj("p0", name="a2"))
    assert _ids(buffer.take(3, actor_version=0, timeout_s=0.0)) == ["a0", "a2"]
    for _ in range(3):  # a group with no survivor is dropped and counted
        buffer.put(_traj("p1", status=TrajectoryStatus.ABORTED))
    m = buffer.metrics()
    assert (m["buffer/failed"], m["buffer/aborted"], m["buffer/dropped_groups"]) == (1, 3, 1)
    assert buffer.num_buffered() == 0
    _assert_accounting(buffer)


def test_group_ids_keep_two_draws_of_one_prompt_apart() -> None:
    buffer = ReadyBuffer(group_size=2)
    for name, gid in [("x0", "p@0"), ("y0", "p@1"), ("y1", "p@1"), ("x1", "p@0")]:
        buffer.put(_traj("p", group_id=gid, name=name))
    assert _ids(buffer.take(2, actor_version=0, timeout_s=0.0)) == ["y0", "y1"]
    assert _ids(buffer.take(2, actor_version=0, timeout_s=0.0)) == ["x0", "x1"]


def test_a_group_with_one_stale_member_is_dropped_whole() -> None:
    buffer = ReadyBuffer(group_size=2, max_staleness=1)
    buffer.put(_traj("p0", [0]))
    buffer.put(_traj("p0", [2]))
    buffer.put(_traj("p1", [2], name="f0"))
    buffer.put(_traj("p1", [1], name="f1"))
    assert _ids(buffer.take(2, actor_version=2, timeout_s=0.0)) == ["f0", "f1"]
    assert buffer.metrics()["buffer/dropped_stale"] == 2


def test_failed_and_aborted_are_counted_and_never_taken() -> None:
    buffer = ReadyBuffer()
    buffer.put(_traj("p0", status=TrajectoryStatus.FAILED))
    buffer.put(_traj("p1", status=TrajectoryStatus.ABORTED))
    buffer.put(_traj("p2", status=TrajectoryStatus.TRUNCATED, name="t"))
    assert _ids(buffer.take(1, actor_version=0, timeout_s=0.0)) == ["t"]
    assert buffer.take(1, actor_version=0, timeout_s=0.01) is None
    running = Trajectory(prompt_id="p3")
    with pytest.raises(ValueError, match="still running"):
        buffer.put(running)
    _assert_accounting(buffer)


def test_a_batch_has_distinct_prompts_unless_configured_otherwise() -> None:
    for distinct, expected in [(True, ["a0", "b0"]), (False, ["a0", "a1"])]:
        buffer = ReadyBuffer(distinct_prompts=distinct)
        for name, prompt in [("a0", "a"), ("a1", "a"), ("b0", "b")]:
            buffer.put(_traj(prompt, name=name))
        assert _ids(buffer.take(2, actor_version=0, timeout_s=0.0)) == expected
    buffer = ReadyBuffer()
    for name in ("a0", "a1"):
        buffer.put(_traj("a", name=name))
    assert buffer.take(2, actor_version=0, timeout_s=0.01) is None  # two of one prompt are not a batch


def test_back_pressure_blocks_producers_until_the_trainer_takes() -> None:
    buffer = ReadyBuffer(max_buffered=2)
    buffer.put(_traj("p0"))
    assert buffer.has_room()
    buffer.put(_traj("p1"))
    assert not buffer.has_room()
    assert buffer.wait_for_room(timeout_s=0.02) is False

    woke = threading.Event()
    thread = threading.Thread(target=lambda: buffer.wait_for_room(timeout_s=10) and woke.set())
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever)
    loop_thread.start()
    try:
        thread.start()
        waiter = asyncio.run_coroutine_threadsafe(asyncio.wait_for(buffer.wait_for_room_async(), 10), loop)
        time.sleep(0.05)
        assert not woke.is_set() and not waiter.done()  # both producers wait while the buffer is full
        assert buffer.take(1, actor_version=0, timeout_s=0.0) is not None
        assert woke.wait(5)
        waiter.result(timeout=5)  # the asyncio producer was woken too, without polling
    finally:
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(5)
        thread.join(5)
        loop.close()


def test_concurrent_producers_lose_and_duplicate_nothing() -> None:
    num_producers, per_producer, batch = 4, 150, 10
    buffer = ReadyBuffer(max_buffered=32)
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        try:
            for i in range(per_producer):
                assert buffer.wait_for_room(timeout_s=20)
                buffer.put(_traj(f"w{p}-{i}", [i % 3], name=f"w{p}-{i}"))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(num_producers)]
    for t in threads:
        t.start()
    taken: list[str] = []
    deadline = time.monotonic() + 30
    while len(taken) < num_producers * per_producer and time.monotonic() < deadline:
        got = buffer.take(batch, actor_version=2, timeout_s=0.5)
        if got is not None:
            assert len(got) == batch and len({t.prompt_id for t in got}) == batch
            taken += [t.trajectory_id for t in got]
            assert buffer.num_buffered() <= 32 + num_producers  # back-pressure holds (each may be mid-put)
    for t in threads:
        t.join(5)
    assert not errors
    assert sorted(taken) == sorted(f"w{p}-{i}" for p in range(num_producers) for i in range(per_producer))
    _assert_accounting(buffer)


def test_state_round_trip_keeps_contents_order_groups_counts_and_wait_times() -> None:
    clock = FakeClock()
    buffer = ReadyBuffer(group_size=2, max_staleness=3, clock=clock)
    routed = _traj("p0", [0, 1], name="a0")
    routed.routed_experts = RoutedExperts(np.array([[[0, 1]], [[2, 3]], [[1, 0]], [[3, 1]], [[-1, -1]]]))
    buffer.put(routed)
    buffer.put(_traj("p0", [1], name="a1"))  # released group
    clock.now = 1.0
    buffer.put(_traj("p1", status=TrajectoryStatus.FAILED))
    buffer.put(_traj("p2", [1], name="c0"))  # open group
    clock.now = 4.0
    state = json.loads(json.dumps(buffer.state_dict()))  # what a checkpoint writes
    assert "routed_experts_packed" in json.dumps(state)  # routing packed, not per-token lists

    clock2 = FakeClock()
    clock2.now = 100.0
    resumed = ReadyBuffer(group_size=2, max_staleness=3, clock=clock2)
    resumed.load_state_dict(state)
    assert resumed.metrics() == buffer.metrics()
    state2 = resumed.state_dict()
    assert state2 == state
    original = buffer.take(2, actor_version=1, timeout_s=0.0)
    restored = resumed.take(2, actor_version=1, timeout_s=0.0)
    assert [trajectory_to_dict(t) for t in restored] == [trajectory_to_dict(t) for t in original]
    assert resumed.metrics()["buffer/wait_s_max"] == 4.0  # a0 waited 4 s before the checkpoint
    resumed.put(_traj("p2", [1], name="c1"))
    assert _ids(resumed.take(2, actor_version=1, timeout_s=0.0)) == ["c0", "c1"]
    _assert_accounting(resumed)
    with pytest.raises(ValueError, match="groups of 2"):
        ReadyBuffer(group_size=1).load_state_dict(state)


def test_wait_time_is_put_to_taken() -> None:
    clock = FakeClock()
    buffer = ReadyBuffer(clock=clock)
    buffer.put(_traj("p0"))
    clock.now = 1.0
    buffer.put(_traj("p1"))
    clock.now = 3.0
    buffer.put(_traj("p2"))
    buffer.take(3, actor_version=0, timeout_s=0.0)
    m = buffer.metrics()
    assert m["buffer/wait_s_mean"] == pytest.approx(5 / 3)
    assert m["buffer/wait_s_p50"] == 2.0 and m["buffer/wait_s_max"] == 3.0


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"group_size": 0}, "algorithm.group_size"), ({"max_staleness": -1}, "algorithm.max_staleness"),
    ({"staleness_check": "step"}, "pipeline.staleness_check"), ({"stale_policy": "mask"}, "pipeline.stale_policy"),
    ({"max_buffered": 0}, "pipeline.max_buffered"),
])
def test_bad_settings_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ReadyBuffer(**kwargs)
