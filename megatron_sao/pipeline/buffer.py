"""The ready buffer: finished trajectories wait here until the trainer takes them.

Producers (the rollout's asyncio thread) `put` every trajectory the moment it finishes; the
trainer, on another thread, blocks in `take` until a batch is ready. One `threading.Condition`
guards everything, so any number of producer threads and one or more consumers are safe.

Groups. With `group_size` G = 1 (SAO) every trainable trajectory is ready at once. With G > 1
(GRPO ablations) a trajectory joins the open group of its key, `metadata["group_id"]` when the
producer sets one, else its `prompt_id`, and the group is released whole when G of its members
have finished. A group is "the first G finished trajectories of that key, in arrival order": if a
prompt is drawn again while an earlier group of it is still open, the two draws may share a
group, which is harmless (every member is a sample of the same prompt); a producer that wants
draws kept apart stamps `group_id` (e.g. `f"{prompt_id}@{epoch}"`).

Statuses. Only COMPLETED and TRUNCATED trajectories are trained on. FAILED and ABORTED ones may
be `put` too: they are counted (`buffer/failed`, `buffer/aborted`) and never taken, and in a
group they fill their slot, so a group whose member failed is released with the survivors
(dropped, and counted, if none survived). Whoever re-queues aborted rollouts (the rollout service)
does it before they reach the buffer: anything put here is final.

Staleness. At `take(batch_size, actor_version)` each ready trajectory's staleness is measured
against `actor_version` (SAO_METHOD: staleness = actor version - the version that sampled a
token), with `staleness_check`:
- `token`: every action token must be within `max_staleness`, i.e. the oldest token decides;
- `trajectory`: the trajectory is as fresh as the policy that finished it (its last action
  token); with partial rollout a long trajectory continued across weight updates passes if its
  end is recent, and the off-policyness of its older tokens is left to DIS.
What exceeds the bound is, by `stale_policy`, dropped (`buffer/dropped_stale`; a group is
dropped whole when any member exceeds) or kept and trained on (`buffer/kept_stale`; DIS masks
the tokens whose ratio left the band). Both are counted, and every batch logs the token
staleness histogram (`staleness/token_frac_{s}`, s = 0..max_staleness, and
`staleness/token_frac_over` beyond it) and the buffer wait times (put -> taken).

Barrier (synchronous baselines, `barrier=True`): every trajectory awaits `wait_for_round_async()`
before it generates (`round_gated` wraps the environments so). When the trainer calls `take` for
a new batch a round opens with as many permits as the batch lacks (`batch_size` minus what the
buffer holds), handed to the waiting trajectories in arrival order; a FAILED or ABORTED one that
is `put` while the round is open gives its permit to the next. The round closes when the batch
is taken. So generation runs only while the trainer waits for a batch and the trainer only while
nothing generates: one round of `batch_size` rollouts per step, every token sampled by the
current actor (staleness 0), as synchronous GRPO does. (The gate sits inside each trajectory, not
in the producer: a producer blocked on its next prompt would stop handing finished trajectories
to the buffer.)

Accounting, a contract checked by the tests: `buffer/put == buffer/taken + buffer/dropped_stale
+ buffer/failed + buffer/aborted + buffer/num_ready + buffer/num_pending` at every moment.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from megatron_sao.algo.diagnostics import staleness_histogram
from megatron_sao.rollout.routing import RoutedExperts
from megatron_sao.rollout.trajectory import Trajectory, TrajectoryStatus
from megatron_sao.rollout.trajectory_io import trajectory_from_dict, trajectory_to_dict

GROUP_ID_KEY = "group_id"
"""`Trajectory.metadata` key of an explicit group id (G > 1); without it the prompt id groups."""
TRAINABLE = (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED)
STATE_FORMAT = 1
COUNTERS = ("put", "taken", "dropped_stale", "kept_stale", "failed", "aborted", "dropped_groups")


@dataclass(slots=True)
class _Entry:
    traj: Trajectory
    put_at: float


@dataclass(slots=True)
class _Group:
    key: str
    prompt_id: str
    members: list[_Entry] = field(default_factory=list)
    num_closed: int = 0  # slots filled by FAILED / ABORTED members

    def staleness(self, actor_version: int, check: str) -> int:
        return max(trajectory_staleness(e.traj, actor_version, check) for e in self.members)


def group_key(traj: Trajectory) -> str:
    value = traj.metadata.get(GROUP_ID_KEY)
    return traj.prompt_id if value is None else str(value)


def trajectory_staleness(traj: Trajectory, actor_version: int, check: str = "token") -> int:
    """Staleness of `traj` at `actor_version`: of its oldest action token (`token`) or of its last
    one (`trajectory`); 0 without action tokens. ValueError if a token is newer than the actor."""
    versions = traj.action_versions()
    if not versions:
        return 0
    if max(versions) > actor_version:
        raise ValueError(f"trajectory {traj.trajectory_id} has tokens of policy version {max(versions)}, newer "
                         f"than the actor's {actor_version}: the version bookkeeping is broken upstream")
    return actor_version - (min(versions) if check == "token" else versions[-1])


class ReadyBuffer:
    """Thread-safe buffer of finished trajectories (see the module docstring for the rules).

    Arguments (proposed config keys in brackets): `group_size` [algorithm.group_size],
    `max_staleness` [algorithm.max_staleness], `staleness_check` token | trajectory
    [pipeline.staleness_check], `stale_policy` drop | keep [pipeline.stale_policy],
    `max_buffered` trajectories held before producers must wait, None = unbounded
    [pipeline.max_buffered], `distinct_prompts` one trajectory (group) per prompt in a batch
    [pipeline.distinct_prompts], `barrier` synchronous rounds (module docstring; every
    trajectory awaits `wait_for_round_async` before generating); `clock` is the time source of
    the wait-time metric.
    """

    def __init__(self, *, group_size: int = 1, max_staleness: int = 4,
                 staleness_check: Literal["token", "trajectory"] = "token",
                 stale_policy: Literal["drop", "keep"] = "drop", max_buffered: int | None = None,
                 distinct_prompts: bool = True, barrier: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if group_size < 1:
            raise ValueError(f"algorithm.group_size must be >= 1, got {group_size}")
        if max_staleness < 0:
            raise ValueError(f"algorithm.max_staleness must be >= 0, got {max_staleness}")
        if staleness_check not in ("token", "trajectory"):
            raise ValueError(f"pipeline.staleness_check must be 'token' or 'trajectory', got {staleness_check!r}")
        if stale_policy not in ("drop", "keep"):
            raise ValueError(f"pipeline.stale_policy must be 'drop' or 'keep', got {stale_policy!r}")
        if max_buffered is not None and max_buffered < 1:
            raise ValueError(f"pipeline.max_buffered must be >= 1 or None, got {max_buffered}")
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.staleness_check = staleness_check
        self.stale_policy = stale_policy
        self.max_buffered = max_buffered
        self.distinct_prompts = distinct_prompts
        self.barrier = barrier
        self.clock = clock
        self.counts: collections.Counter[str] = collections.Counter()
        self._ready: collections.deque[_Group] = collections.deque()
        self._pending: dict[str, _Group] = {}
        self._cond = threading.Condition()
        self._room_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._batch_metrics: dict[str, float] = {}
        self._round_open = False  # barrier: a consumer waits for a batch that is not complete
        self._permits = 0  # barrier: trajectories the open round may still start
        self._round_waiters: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = \
            collections.deque()

    # ---- producers -------------------------------------------------------------------------------

    def put(self, traj: Trajectory) -> None:
        """Add one finished trajectory (any final status; see the module docstring)."""
        if traj.status == TrajectoryStatus.RUNNING:
            raise ValueError(f"trajectory {traj.trajectory_id} is still running; only finished ones enter the buffer")
        with self._cond:
            self.counts["put"] += 1
            trainable = traj.status in TRAINABLE
            if not trainable:
                self.counts[str(traj.status)] += 1
                if self.barrier and self._round_open:  # its permit goes to the next trajectory
                    self._permits += 1
                    self._grant_permits()
            if self.group_size == 1:
                if trainable:
                    self._ready.append(_Group(traj.trajectory_id, traj.prompt_id, [_Entry(traj, self.clock())]))
                    self._cond.notify_all()
                return
            key = group_key(traj)
            group = self._pending.setdefault(key, _Group(key, traj.prompt_id))
            if trainable:
                group.members.append(_Entry(traj, self.clock()))
            else:
                group.num_closed += 1
            if len(group.members) + group.num_closed >= self.group_size:
                del self._pending[key]
                if group.members:
                    self._ready.append(group)
                    self._cond.notify_all()
                else:
                    self.counts["dropped_groups"] += 1

    async def wait_for_round_async(self) -> None:
        """Barrier: wait for a permit of the open round (see the module docstring) before
        generating; returns at once without a barrier."""
        if not self.barrier:
            return
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._permits > 0 and not self._round_waiters:
                self._permits -= 1
                return
            future = loop.create_future()
            self._round_waiters.append((loop, future))
        try:
            await future
        except asyncio.CancelledError:
            with self._cond:
                if (loop, future) in self._round_waiters:
                    self._round_waiters.remove((loop, future))
                elif self._round_open:  # granted, then cancelled: the permit goes to the next one
                    self._permits += 1
                    self._grant_permits()
            raise

    def num_ready(self) -> int:
        """Trainable trajectories released and waiting to be taken."""
        with self._cond:
            return sum(len(g.members) for g in self._ready)

    def num_buffered(self) -> int:
        """Trajectories held: released ones plus members of groups still open."""
        with self._cond:
            return self._num_buffered()

    def has_room(self) -> bool:
        """Whether a producer may start a new prompt (back-pressure: fewer than `max_buffered` held)."""
        with self._cond:
            return self._has_room()

    def wait_for_room(self, timeout_s: float | None = None) -> bool:
        """Block a producer thread until `has_room()`; False on timeout."""
        with self._cond:
            return self._cond.wait_for(self._has_room, timeout=timeout_s)

    async def wait_for_room_async(self) -> None:
        """Await room from an asyncio producer without blocking its event loop (woken by `take`)."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._has_room():
                    return
                future = loop.create_future()
                self._room_waiters.append((loop, future))
            try:
                await future
            finally:
                with self._cond:
                    if (loop, future) in self._room_waiters:
                        self._room_waiters.remove((loop, future))

    # ---- the consumer ----------------------------------------------------------------------------

    def take(self, batch_size: int, actor_version: int, timeout_s: float | None = None) -> list[Trajectory] | None:
        """`batch_size` trainable trajectories (G > 1: `batch_size // G` whole groups, fewer
        trajectories if members failed), oldest first, from distinct prompts unless configured
        otherwise, stale ones handled by `stale_policy`. Blocks up to `timeout_s` (None: forever);
        returns None on timeout, having taken nothing."""
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if batch_size % self.group_size:
            raise ValueError(f"data.batch_size {batch_size} is not a multiple of algorithm.group_size "
                             f"{self.group_size}: batches are made of whole groups")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._drop_stale(actor_version)
                chosen = self._select(batch_size // self.group_size)
                if chosen is not None:
                    self._round_open, self._permits = False, 0
                    return self._take(chosen, actor_version)
                if self.barrier and not self._round_open:  # a consumer waits: the round opens
                    self._round_open = True
                    self._permits = max(0, batch_size - self._num_buffered())
                    self._grant_permits()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def metrics(self) -> dict[str, float]:
        """Cumulative counts, current sizes and the last batch's staleness and wait times."""
        with self._cond:
            out = {f"buffer/{k}": float(self.counts[k]) for k in COUNTERS}
            out["buffer/num_ready"] = float(sum(len(g.members) for g in self._ready))
            out["buffer/num_pending"] = float(sum(len(g.members) for g in self._pending.values()))
            return {**out, **self._batch_metrics}

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready contents: released and open groups in order, their members' time in the
        buffer so far, and the counters."""
        with self._cond:
            now = self.clock()

            def group(g: _Group) -> dict[str, Any]:
                return {"key": g.key, "prompt_id": g.prompt_id, "num_closed": g.num_closed,
                        "members": [{"trajectory": _record(e.traj), "waited_s": now - e.put_at}
                                    for e in g.members]}

            return {"format": STATE_FORMAT, "group_size": self.group_size, "counts": dict(self.counts),
                    "ready": [group(g) for g in self._ready], "pending": [group(g) for g in self._pending.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with a `state_dict()`'s; wait times continue from where they were
        (the time the run was down does not count)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"ready-buffer state format {state.get('format')!r} is not {STATE_FORMAT}")
        if state["group_size"] != self.group_size:
            raise ValueError(f"the checkpoint's buffer holds groups of {state['group_size']}, this run's "
                             f"algorithm.group_size is {self.group_size}")
        with self._cond:
            now = self.clock()

            def group(g: dict[str, Any]) -> _Group:
                members = [_Entry(_from_record(m["trajectory"]), now - float(m["waited_s"]))
                           for m in g["members"]]
                return _Group(str(g["key"]), str(g["prompt_id"]), members, int(g["num_closed"]))

            self.counts = collections.Counter({k: int(v) for k, v in state["counts"].items()})
            self._ready = collections.deque(group(g) for g in state["ready"])
            self._pending = {g.key: g for g in map(group, state["pending"])}
            self._batch_metrics = {}
            self._cond.notify_all()

    # ---- internals (called with the lock held) ---------------------------------------------------

    def _num_buffered(self) -> int:
        return sum(len(g.members) for g in self._ready) + sum(len(g.members) for g in self._pending.values())

    def _has_room(self) -> bool:
        return self.max_buffered is None or self._num_buffered() < self.max_buffered

    def _grant_permits(self) -> None:
        """Hand the open round's permits to waiting trajectories, oldest first."""
        while self._permits > 0 and self._round_waiters:
            loop, future = self._round_waiters.popleft()
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # that loop is closed: its trajectory is gone, the permit is not
                continue
            self._permits -= 1

    def _drop_stale(self, actor_version: int) -> None:
        """Drop released groups past the bound (policy `drop`): the actor only gets newer, so a
        stale trajectory never becomes trainable again."""
        if self.stale_policy != "drop":
            return
        kept = collections.deque()
        for g in self._ready:
            if g.staleness(actor_version, self.staleness_check) > self.max_staleness:
                self.counts["dropped_stale"] += len(g.members)
            else:
                kept.append(g)
        if len(kept) != len(self._ready):
            self._ready = kept
            self._wake_producers()

    def _select(self, num_groups: int) -> list[_Group] | None:
        chosen: list[_Group] = []
        prompts: set[str] = set()
        for g in self._ready:
            if self.distinct_prompts and g.prompt_id in prompts:
                continue
            chosen.append(g)
            prompts.add(g.prompt_id)
            if len(chosen) == num_groups:
                return chosen
        return None

    def _take(self, chosen: list[_Group], actor_version: int) -> list[Trajectory]:
        ids = {id(g) for g in chosen}
        self._ready = collections.deque(g for g in self._ready if id(g) not in ids)
        entries = [e for g in chosen for e in g.members]
        now = self.clock()
        stale = sum(trajectory_staleness(e.traj, actor_version, self.staleness_check) > self.max_staleness
                    for e in entries)
        self.counts["taken"] += len(entries)
        self.counts["kept_stale"] += stale
        self._batch_metrics = {**staleness_metrics([e.traj for e in entries], actor_version, self.max_staleness),
                               **wait_metrics([now - e.put_at for e in entries]),
                               "buffer/batch_stale": float(stale)}
        self._wake_producers()
        return [e.traj for e in entries]

    def _wake_producers(self) -> None:
        self._cond.notify_all()
        if not self._has_room():
            return
        for loop, future in self._room_waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: its producer is gone
                loop.call_soon_threadsafe(_resolve, future)
        self._room_waiters.clear()


def round_gated(env_factory: Callable[[Any], Any], buffer: ReadyBuffer) -> Callable[[Any], Any]:
    """The barrier's other half: environments whose `reset` first awaits a permit of `buffer`'s
    round, so a trajectory generates nothing before its round opens (wrap the rollout's
    environment factory with it when `buffer.barrier`)."""
    from megatron_sao.rollout.environment import Environment

    class RoundGated(Environment):
        def __init__(self, env: Any) -> None:
            self.env = env

        async def reset(self, sample: Any) -> list[dict[str, str]]:
            await buffer.wait_for_round_async()
            return await self.env.reset(sample)

        @property
        def tools(self) -> Any:
            return self.env.tools

        async def step(self, action_text: str) -> Any:
            return await self.env.step(action_text)

        async def close(self) -> None:
            await self.env.close()

    return lambda sample: RoundGated(env_factory(sample))


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def staleness_metrics(trajectories: list[Trajectory], actor_version: int, max_staleness: int) -> dict[str, float]:
    """Token staleness of a batch: mean, max, and the histogram as fractions of action tokens,
    `staleness/token_frac_{s}` for s = 0..max_staleness and `staleness/token_frac_over` beyond."""
    versions = [v for t in trajectories for v in t.policy_versions]
    mask = [m == 1 for t in trajectories for m in t.loss_mask]
    if not any(mask):
        return {}
    versions_bt = torch.tensor([versions], dtype=torch.int64)
    mask_bt = torch.tensor([mask], dtype=torch.bool)
    counts = staleness_histogram(versions_bt, actor_version, mask_bt, max_staleness=max_staleness + 1).tolist()
    total = sum(counts)
    ages = [actor_version - v for v, m in zip(versions, mask, strict=True) if m]
    out = {f"staleness/token_frac_{s}": counts[s] / total for s in range(max_staleness + 1)}
    out["staleness/token_frac_over"] = counts[-1] / total
    out["staleness/mean"] = sum(ages) / len(ages)
    out["staleness/max"] = float(max(ages))
    return out


def wait_metrics(waits_s: list[float]) -> dict[str, float]:
    """Time the batch's trajectories spent in the buffer (put -> taken): mean, median, max."""
    if not waits_s:
        return {}
    return {"buffer/wait_s_mean": math.fsum(waits_s) / len(waits_s), "buffer/wait_s_p50": statistics.median(waits_s),
            "buffer/wait_s_max": max(waits_s)}


def _record(traj: Trajectory) -> dict[str, Any]:
    """A buffered trajectory in the checkpoint's JSON: its routed experts packed (base64 int16),
    not as the per-token lists of the JSONL form (a few KB per token of an indented JSON file)."""
    record = trajectory_to_dict(traj, with_routing=False)
    if traj.routed_experts is not None:
        record["routed_experts_packed"] = traj.routed_experts.pack()
    return record


def _from_record(record: dict[str, Any]) -> Trajectory:
    traj = trajectory_from_dict(record)
    if record.get("routed_experts_packed") is not None:
        traj.routed_experts = RoutedExperts.unpack(record["routed_experts_packed"])
    return traj
