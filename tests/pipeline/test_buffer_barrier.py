"""The ready buffer's barrier (synchronous baselines): trajectories generate only with a permit of
the round that a waiting `take` opens, one batch's worth, refilled for failures."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megatron_sao.pipeline.buffer import GROUP_ID_KEY, ReadyBuffer
from megatron_sao.rollout.trajectory import FinishType, RewardKind, Trajectory, TrajectoryStatus


def _traj(prompt_id: str, status: TrajectoryStatus = TrajectoryStatus.COMPLETED,
          group_id: str | None = None) -> Trajectory:
    traj = Trajectory(prompt_id=prompt_id, metadata={GROUP_ID_KEY: group_id} if group_id else {})
    traj.set_prompt([1, 2, 3])
    traj.append_action([7], [-0.5], [0], FinishType.STOP)
    traj.add_reward(1.0, RewardKind.TERMINAL)
    traj.finish(status)
    return traj


def _take_in_thread(buffer: ReadyBuffer, batch_size: int) -> tuple[threading.Thread, list]:
    got: list = []
    thread = threading.Thread(target=lambda: got.append(buffer.take(batch_size, actor_version=0, timeout_s=10)))
    thread.start()
    return thread, got


async def _started(tasks: list[asyncio.Task], count: int, timeout_s: float = 5.0) -> list[int]:
    """Indices of the waiters that got a permit, once `count` of them have (in-order check below)."""
    deadline = time.monotonic() + timeout_s
    while sum(t.done() for t in tasks) < count:
        assert time.monotonic() < deadline, f"only {sum(t.done() for t in tasks)} of {count} permits came"
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # a permit beyond `count` would show up here
    return [i for i, t in enumerate(tasks) if t.done()]


def test_a_waiting_take_opens_one_round_granted_in_arrival_order_and_failures_are_refilled() -> None:
    buffer = ReadyBuffer(barrier=True)

    async def scenario() -> None:
        waiters = [asyncio.create_task(buffer.wait_for_round_async()) for _ in range(6)]
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiters)  # nobody waits for a batch: nothing generates
        thread, got = _take_in_thread(buffer, batch_size=3)
        assert await _started(waiters, 3) == [0, 1, 2]
        buffer.put(_traj("p0", status=TrajectoryStatus.FAILED))  # its permit goes to the next waiter
        assert await _started(waiters, 4) == [0, 1, 2, 3]
        for i in (1, 2, 3):
            buffer.put(_traj(f"p{i}"))
        await asyncio.to_thread(thread.join, 10)
        assert [t.prompt_id for t in got[0]] == ["p1", "p2", "p3"]
        assert await _started(waiters, 4) == [0, 1, 2, 3]  # the round closed with the batch
        thread, got = _take_in_thread(buffer, batch_size=3)  # the next round
        assert await _started(waiters, 6) == [0, 1, 2, 3, 4, 5]
        for w in waiters:
            w.cancel()
        buffer.put(_traj("p4"))
        buffer.put(_traj("p5"))
        buffer.put(_traj("p6"))
        await asyncio.to_thread(thread.join, 10)

    asyncio.run(scenario())


def test_a_round_grants_only_what_the_batch_lacks() -> None:
    buffer = ReadyBuffer(group_size=2, barrier=True)
    buffer.put(_traj("a", group_id="a@0"))  # half a group from an earlier round

    async def scenario() -> None:
        waiters = [asyncio.create_task(buffer.wait_for_round_async()) for _ in range(5)]
        thread, got = _take_in_thread(buffer, batch_size=4)
        assert await _started(waiters, 3) == [0, 1, 2]  # 4 - 1 held
        for prompt in ("a", "b", "b"):
            buffer.put(_traj(prompt, group_id=f"{prompt}@0"))
        await asyncio.to_thread(thread.join, 10)
        assert sorted(t.prompt_id for t in got[0]) == ["a", "a", "b", "b"]
        for w in waiters:
            w.cancel()

    asyncio.run(scenario())


def test_a_cancelled_permit_holder_passes_its_permit_on() -> None:
    buffer = ReadyBuffer(barrier=True)

    async def scenario() -> None:
        first = asyncio.create_task(buffer.wait_for_round_async())
        await asyncio.sleep(0.01)
        thread, _ = _take_in_thread(buffer, batch_size=1)
        await asyncio.wait_for(first, 5)
        second = asyncio.create_task(buffer.wait_for_round_async())
        await asyncio.sleep(0.05)
        assert not second.done()  # the one permit is taken
        # The trajectory holding it is aborted and put: its permit goes to the next.
        buffer.put(_traj("p0", status=TrajectoryStatus.ABORTED))
        await asyncio.wait_for(second, 5)
        buffer.put(_traj("p1"))
        await asyncio.to_thread(thread.join, 10)

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_without_barrier_trajectories_never_wait() -> None:
    buffer = ReadyBuffer(max_buffered=1)
    asyncio.run(asyncio.wait_for(buffer.wait_for_round_async(), 1))
    buffer.put(_traj("p0"))
    assert not buffer.has_room()  # back-pressure is unchanged


def test_gated_environments_reset_only_inside_a_round_and_delegate_the_rest() -> None:
    from megatron_sao.pipeline.buffer import round_gated
    from megatron_sao.rollout.environment import Environment, PromptSample, StepResult

    calls: list[str] = []
    tools = [{"type": "function", "function": {"name": "f"}}]

    class Env(Environment):
        @property
        def tools(self):
            return tools

        async def reset(self, sample):
            calls.append("reset")
            return [{"role": "user", "content": "hi"}]

        async def step(self, action_text):
            calls.append(f"step:{action_text}")
            return StepResult(observation="", done=True)

        async def close(self):
            calls.append("close")

    buffer = ReadyBuffer(barrier=True)
    env = round_gated(lambda sample: Env(), buffer)(PromptSample(prompt_id="p", messages=[]))

    async def scenario() -> None:
        reset = asyncio.create_task(env.reset(PromptSample(prompt_id="p", messages=[])))
        await asyncio.sleep(0.1)
        assert calls == []  # no round: the episode has not started
        thread, _ = _take_in_thread(buffer, batch_size=1)
        assert await asyncio.wait_for(reset, 5) == [{"role": "user", "content": "hi"}]
        assert (await env.step("a")).done and env.tools == tools
        await env.close()
        buffer.put(_traj("p"))
        await asyncio.to_thread(thread.join, 10)

    asyncio.run(scenario())
    assert calls == ["reset", "step:a", "close"]
