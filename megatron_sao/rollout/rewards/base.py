"""Reward functions' contract, and the wrapper that keeps a failing one from killing the run.

A reward function takes a `RewardInput` and returns a real number; it may be sync or async.
`SafeReward` is how environments and the agent loop call one: it runs sync functions off the
event loop (a thread, or a process pool that is replaced when a call hangs or a worker dies),
applies a timeout, checks the value is a finite number, and turns every failure into a
`RewardOutcome` with a reason. Failures are counted by reason and logged, never raised; the
caller marks the trajectory failed (environments put the reason under `REWARD_ERROR_KEY` in
`StepResult.info`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import multiprocessing
import numbers
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from megatron_sao.rollout.environment import PromptSample

logger = logging.getLogger(__name__)

REWARD_ERROR_KEY = "reward_error"
"""`StepResult.info` key an environment sets (to the reason) when its reward function failed."""

_LOGGED_FAILURES = 10  # per SafeReward, with tracebacks; later ones go to DEBUG (still counted)


@dataclass(slots=True)
class RewardInput:
    """What a reward function sees: the sample (with its reference `answer` and metadata), the
    final assistant text, and the whole conversation (tool turns included) for judges."""

    sample: PromptSample
    response: str
    messages: list[dict[str, str]] = field(default_factory=list)


RewardFn = Callable[[RewardInput], float] | Callable[[RewardInput], Awaitable[float]]


@dataclass(slots=True)
class RewardOutcome:
    """A reward, or why there is none (`reward is None` exactly when `error` is set)."""

    reward: float | None
    error: str | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class RewardStats:
    """Counts a run can log: how many rewards were computed and why the others failed."""

    num_ok: int = 0
    num_failed: int = 0
    failures: Counter[str] = field(default_factory=Counter)


def _is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class SafeReward:
    """Calls a reward function so that nothing it does can take the run down.

    `processes > 0` runs a sync function in its own pool of that many spawned processes:
    math checkers (sympy) can hang in ways a thread cannot be stopped from, and in a worker's
    main thread math-verify's own signal-based timeouts work. On a timeout the pool is killed
    and rebuilt. With `processes == 0` sync functions run in the loop's default thread pool and
    a timed-out call keeps its thread until it returns.
    """

    def __init__(self, fn: RewardFn, *, name: str | None = None, timeout_s: float | None = 30.0,
                 processes: int = 0) -> None:
        if not callable(fn):
            raise ValueError(f"SafeReward: {fn!r} is not callable")
        if processes < 0 or (timeout_s is not None and timeout_s <= 0):
            raise ValueError(f"SafeReward: processes must be >= 0 and timeout_s > 0 or None, "
                             f"got {processes}, {timeout_s}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.timeout_s = timeout_s
        self.processes = processes
        self.stats = RewardStats()
        self._pool: ProcessPoolExecutor | None = None

    async def __call__(self, inp: RewardInput) -> RewardOutcome:
        start = time.monotonic()
        try:
            value = await asyncio.wait_for(self._invoke(inp), self.timeout_s)
            reward = _check_value(value)
        except TimeoutError:
            self._discard_pool()
            return self._fail(inp, "timeout", f"timed out after {self.timeout_s:g} s", start)
        except BrokenProcessPool as e:
            self._discard_pool()
            return self._fail(inp, "worker_died", f"reward worker process died: {e}", start)
        except _BadRewardValue as e:
            return self._fail(inp, "bad_value", str(e), start)
        except Exception as e:
            return self._fail(inp, f"exception:{type(e).__name__}", f"{type(e).__name__}: {e}", start, exc=e)
        self.stats.num_ok += 1
        return RewardOutcome(reward=reward, duration_s=time.monotonic() - start)

    async def _invoke(self, inp: RewardInput) -> object:
        if _is_async(self.fn):
            return await self.fn(inp)  # type: ignore[misc]
        loop = asyncio.get_running_loop()
        executor: Executor | None = None
        if self.processes:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
            executor = self._pool
        value = await loop.run_in_executor(executor, self.fn, inp)
        if inspect.isawaitable(value):
            value = await value
        return value

    def _fail(self, inp: RewardInput, kind: str, message: str, start: float,
              exc: BaseException | None = None) -> RewardOutcome:
        self.stats.num_failed += 1
        self.stats.failures[kind] += 1
        level = logging.WARNING if self.stats.num_failed <= _LOGGED_FAILURES else logging.DEBUG
        logger.log(level, "reward %r failed on prompt %r: %s (%d failures so far)", self.name,
                   inp.sample.prompt_id, message, self.stats.num_failed, exc_info=exc)
        return RewardOutcome(reward=None, error=message, duration_s=time.monotonic() - start)

    def _discard_pool(self) -> None:
        """Kill the workers (a hung one would hold its slot forever) and start afresh next call."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # ProcessPoolExecutor has no public way to stop a running task; its private `_processes`
        # map (stable since 3.2) is the only handle on a hung worker. Absent, workers finish alone.
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the worker processes, if any."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class _BadRewardValue(ValueError):
    """The function returned, but not a finite real number (bools count as 0 / 1)."""


def _check_value(value: object) -> float:
    if not isinstance(value, numbers.Real):
        raise _BadRewardValue(f"reward must be a real number, got {type(value).__name__}: {value!r:.80}")
    reward = float(value)
    if not math.isfinite(reward):
        raise _BadRewardValue(f"reward must be finite, got {reward}")
    return reward
