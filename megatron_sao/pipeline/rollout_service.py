"""The rollout side of a run: engines, the agent loop and the ready buffer, on a thread of its own.

`RolloutService` runs an asyncio loop on a background thread: it starts the engine servers
(`rollout.engine_supervisor.EngineSupervisor`: SGLang on GPU, the CPU engine here; restarted when they die),
runs the agent loop over the prompt stream with at most `rollout.max_inflight_per_engine`
trajectories per engine, and puts every finished trajectory into the `ReadyBuffer` the moment it
completes. The trainer, on the calling thread, takes batches from the buffer and hands new
weights back through `paused` (pause in place -> load -> continue: trajectories still
generating keep their tokens and continue under the new weights, each token tagged with the
version that sampled it). Colocated runs suspend the engines while the trainer steps
(`suspend`: retract + release memory; `resume_weights` before the push; `resume` after it).

Back-pressure: no new prompt starts while the buffer has no room (`pipeline.max_buffered`).
Accounting (a contract: `rollout/started == completed + aborted + failed + in_flight` at every
step): a prompt is `started` when its trajectory starts; it ends `completed` (COMPLETED or
TRUNCATED, handed to the buffer), `failed` (the environment or reward failed) or `aborted`
(engine-side abort, e.g. shutdown); an aborted prompt is started again (`rollout/requeued`) so
nothing is lost.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from megatron_sao.rollout.environment import PromptSample
from megatron_sao.rollout.trajectory import Trajectory, TrajectoryStatus

if TYPE_CHECKING:  # the engine side is imported when a rollout starts
    from megatron_sao.rollout.agent_loop import AgentLoopConfig
    from megatron_sao.rollout.serving import EngineFleet, Serving

logger = logging.getLogger(__name__)

T = TypeVar("T")

RELEASED_TYPES = ("kv_cache", "weights", "cuda_graph")
"""What `suspend` releases: every type (sglang 0.5.23 srt/constants.py GPU_MEMORY_ALL_TYPES)."""


class RolloutService:
    """Engines + agent loop feeding `buffer` from `prompts`; every public method is called from
    the trainer's thread."""

    def __init__(self, engine_config: Any, agent_config: AgentLoopConfig, tokenizer: Any,
                 env_factory: Callable[..., Any], prompts: Iterator[PromptSample], buffer: Any,
                 max_inflight_per_engine: int, health_interval_s: float = 5.0, health_timeout_s: float = 10.0,
                 health_failures: int = 3,
                 make_supervisor: Callable[[Any], EngineFleet] | None = None) -> None:
        self.engine_config = engine_config
        # The engine supervisor: local processes (`EngineSupervisor`) unless the run places its
        # engines elsewhere (`pipeline.placement.make_engine_supervisor`: Ray actors).
        self.make_supervisor = make_supervisor
        self.agent_config = agent_config
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.prompts = prompts
        self.buffer = buffer
        self.max_inflight_per_engine = max_inflight_per_engine
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.health_failures = health_failures
        self.counts: collections.Counter[str] = collections.Counter()
        self._requeue: collections.deque[PromptSample] = collections.deque()
        self._in_flight: dict[str, list[PromptSample]] = collections.defaultdict(list)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout", daemon=True)
        self._stopping = False
        self._suspended = False
        self._released: list[str] = []
        """Colocated: the memory types `suspend` released and `resume` has not given back yet."""
        self._suspended_urls: list[str] = []
        """The engines `suspend` paused and released (only these are resumed: resuming memory an
        engine never released stops it, as in 0.5.23, e.g. one restarted meanwhile)."""
        self._paused: set[str] = set()
        """URLs of the engines this service paused (suspend, a weight update): SGLang 0.5.23 answers
        no health check while paused (the probe waits behind the pause), so the watchdog skips them."""
        self._task: asyncio.Future | None = None
        self._watchdog: asyncio.Future | None = None
        self.serving: Serving | None = None
        # Its parts once started (tests and tools set them on their own): an `EngineFleet`, the
        # `EnginePool`, the `Runner` (rollout/serving.py).
        self.supervisor: Any = None
        self.pool: Any = None
        self.agent: Any = None
        self.error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Start the engines (blocking until healthy) and the rollout; returns the engine URLs."""
        from megatron_sao.rollout.serving import Serving

        # The one rollout composition (`rollout/serving.py`): engines, pool, and the runner that
        # fits the environment (`AgentLoop`, or `ScaffoldRunner` for a gateway scaffold).
        self.serving = Serving(self.engine_config, self.agent_config, self.tokenizer, self.env_factory,
                               self.max_inflight_per_engine, self.make_supervisor)
        urls = self.serving.start_engines()
        self.supervisor = self.serving.fleet
        self._thread.start()
        self.agent = self.run(self.serving.open())  # the clients live on the rollout thread's loop
        self.pool = self.serving.pool
        self._task = asyncio.run_coroutine_threadsafe(self._produce(), self._loop)
        self._watchdog = asyncio.run_coroutine_threadsafe(self._watch(), self._loop)
        return urls

    def stop(self) -> None:
        """Abort what is generating, stop the engines and the thread."""
        self._stopping = True
        if self.agent is not None and self._thread.is_alive():
            self.run(self.agent.abort(), timeout_s=60)
        for task in (self._task, self._watchdog):
            if task is not None:
                task.cancel()
        if self.serving is not None and self._thread.is_alive():
            self.run(self.serving.aclose(), timeout_s=60)  # the runner's gateway (scaffolds), the pool
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if self.serving is not None:
            self.serving.stop_engines()

    # ---- called by the trainer ---------------------------------------------------------------

    def suspend(self) -> None:
        """Colocated placement: the trainer is about to use the devices. In SGLang 0.5.23's order:
        pause with `retract` (running requests go back to the queue, their KV dropped: the engine is
        then idle, which `release_memory_occupation` asserts, and an in-place pause would keep KV
        that is about to be freed), then release every memory type (weights, KV cache, CUDA
        graphs; only with `--enable-memory-saver` does this free anything). `resume_weights`,
        the weight push and `resume` undo it."""
        self.raise_if_failed()
        clients = self.pool.clients

        async def suspend() -> list[Any]:
            paused = await self._each(clients, lambda c: c.pause_generation("retract"))
            self._paused.update(c.base_url for c in paused)
            return await self._each(paused, lambda c: c.release_memory_occupation())

        released = self.run(suspend())
        self._suspended = True
        self._released = list(RELEASED_TYPES)
        self._suspended_urls = [c.base_url for c in released]

    def _suspended_clients(self) -> list[Any]:
        return [c for c in self.pool.clients if c.base_url in self._suspended_urls]

    def resume_weights(self) -> None:
        """Colocated, before a weight push: give the engines their weight memory back (a push into
        released weights would write into freed memory; slime and verl resume `weights` first)."""
        if not self._suspended or "weights" not in self._released:
            return
        resumed = self.run(self._each(self._suspended_clients(), lambda c: c.resume_memory_occupation(["weights"])))
        self._suspended_urls = [c.base_url for c in resumed]
        self._released.remove("weights")

    def resume(self) -> None:
        """Colocated, after the trainer's step (and push): the rest of the memory back, then
        generation continues (retracted requests are prefilled again)."""
        clients = self._suspended_clients()
        tags = list(self._released)

        async def resume() -> None:
            resumed = await self._each(clients, lambda c: c.resume_memory_occupation(tags)) if tags else clients
            await self._each(resumed, lambda c: c.continue_generation())

        self.run(resume())
        self._paused.clear()  # nothing else is paused while suspended (pause_for_update adds none then)
        self._suspended, self._released, self._suspended_urls = False, [], []

    @contextlib.contextmanager
    def paused(self, clients: list[Any]) -> Iterator[list[Any]]:
        """Pause `clients` in place for a weight update and yield those that paused (an engine
        that died meanwhile is left out, marked unhealthy); continue them on exit. Trajectories
        still generating keep their tokens and go on under the new weights (each token tagged with
        the version that sampled it): partial rollout, not restart."""
        paused = self.pause_for_update(clients)
        try:
            yield paused
        finally:
            self.continue_after_update(paused)

    def pause_for_update(self, clients: list[Any]) -> list[Any]:
        """`paused`'s first half (also called on its own across a process boundary,
        `pipeline/rollout_actor.py`): pause `clients` in place; returns those that paused."""
        self.raise_if_failed()
        if self._suspended:  # colocated: already paused, `resume` continues after the update
            return list(clients)
        self._paused.update(c.base_url for c in clients)
        paused = self.run(self._each(clients, lambda c: c.pause_generation("in_place")))
        self._paused.difference_update(c.base_url for c in clients if c not in paused)
        return paused

    def continue_after_update(self, paused: list[Any]) -> None:
        """`paused`'s second half: continue what `pause_for_update` paused."""
        if not self._suspended:
            self.run(self._each(paused, lambda c: c.continue_generation()))
            self._paused.difference_update(c.base_url for c in paused)

    async def _each(self, clients: list[Any], call: Callable[[Any], Awaitable[Any]]) -> list[Any]:
        """`call` on every client at once; returns those it succeeded on (the others are marked
        unhealthy: the pool probes them until their restart answers)."""
        results = await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
        ok = []
        for client, result in zip(clients, results, strict=True):
            if isinstance(result, Exception):
                logger.warning("engine %s: %r", client.base_url, result)
                await self.pool.mark_unhealthy(client)
            else:
                ok.append(client)
        return ok

    def healthy_clients(self) -> list[Any]:
        return self.pool.healthy_clients()

    def lagging_clients(self, version: str) -> list[Any]:
        """Healthy engines whose weight version is not `version` (e.g. restarted after a crash)."""

        async def versions() -> list[Any]:
            clients = self.pool.healthy_clients()
            got = await asyncio.gather(*(c.get_weight_version() for c in clients), return_exceptions=True)
            return [c for c, v in zip(clients, got, strict=True) if not isinstance(v, Exception) and v != version]

        return self.run(versions())

    def run(self, coro: Awaitable[T], timeout_s: float | None = None) -> T:
        """Run `coro` on the rollout thread's loop (where the engine clients live) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout_s)

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the rollout thread's loop without waiting (evaluation during training)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def metrics(self) -> dict[str, float]:
        """The accounting (cumulative) and what the engines do now."""
        c = self.counts
        finished = c["completed"] + c["aborted"] + c["failed"]
        out = {f"rollout/{k}": float(c[k]) for k in ("started", "completed", "aborted", "failed", "requeued",
                                                     "engine_hangs")}
        out["rollout/in_flight"] = float(c["started"] - finished)
        out["rollout/engine_restarts"] = float(self.supervisor.total_restarts()) if self.supervisor else 0.0
        return out

    def raise_if_failed(self) -> None:
        if self._task is not None and self._task.done() and not self._task.cancelled():
            error = self._task.exception()
            if error is not None:
                raise RuntimeError(f"the rollout stopped: {error!r}") from error

    # ---- the rollout thread -------------------------------------------------------------------

    async def _samples(self):
        while not self._stopping:
            if not self.buffer.has_room():
                await self.buffer.wait_for_room_async()  # back-pressure: start nothing while it is full
            if self._requeue:
                sample = self._requeue.popleft()
                self.counts["requeued"] += 1
            else:
                sample = next(self.prompts, None)
                if sample is None:
                    return
            self.counts["started"] += 1
            self._in_flight[sample.prompt_id].append(sample)
            yield sample

    async def _watch(self) -> None:
        """A process that is alive but no longer answers (hung) is killed after `health_failures`
        failed checks in a row; the supervisor then restarts it and the agent loop re-sends its
        calls to a healthy engine. (A dead process is the supervisor's own business.) Engines this
        service paused are not checked: SGLang 0.5.23's health probe is a generate request, which
        waits behind the pause (`TokenizerManager.generate_request`, `is_pause_cond`)."""
        failures: collections.Counter[int] = collections.Counter()
        while not self._stopping:
            await asyncio.sleep(self.health_interval_s)
            for index, client in enumerate(self.pool.clients):
                if client.base_url in self._paused or not await asyncio.to_thread(self.supervisor.alive, index):
                    failures[index] = 0  # paused by us, or dead / restarting: not a hang
                    continue
                ok = await client.health_generate(timeout_s=self.health_timeout_s)
                if client.base_url in self._paused:  # paused while the check was under way
                    failures[index] = 0
                    continue
                failures[index] = 0 if ok else failures[index] + 1
                if failures[index] >= self.health_failures:
                    logger.warning("engine %s answered no health check for %d tries: killing it to restart",
                                   client.base_url, failures[index])
                    self.counts["engine_hangs"] += 1
                    failures[index] = 0
                    self.supervisor.kill(index)

    async def _produce(self) -> None:
        async for traj in self.agent.iter_trajectories(self._samples()):
            self._finish(traj)

    def _finish(self, traj: Trajectory) -> None:
        if traj.metadata.get("last_segment", True) is False:
            # An earlier segment of a scaffold episode whose history was rewritten: trained on,
            # but the episode is accounted for once, with its last segment.
            if traj.status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED):
                self.buffer.put(traj)
            return
        samples = self._in_flight[traj.prompt_id]
        sample = samples.pop() if samples else None
        if not samples:
            self._in_flight.pop(traj.prompt_id, None)
        if traj.status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED):
            self.counts["completed"] += 1
            self.buffer.put(traj)
        elif traj.status == TrajectoryStatus.ABORTED:
            self.counts["aborted"] += 1
            if not self._stopping and sample is not None:
                self._requeue.append(sample)  # started again (its group slot stays open for it)
            else:
                self.buffer.put(traj)  # counted there, never trained on; closes its group slot
        else:
            self.counts["failed"] += 1
            self.buffer.put(traj)
            logger.warning("trajectory %s (prompt %s) failed: %s", traj.trajectory_id, traj.prompt_id,
                           traj.status_reason)

    def state_dict(self) -> dict[str, Any]:
        """The counters, with the prompts still in flight taken back out of `started`: a resumed
        run starts them again (`pending_samples` go into the prompt stream's state)."""
        counts = dict(self.counts)
        counts["started"] = counts.get("started", 0) - len(self.pending_samples())
        return {"counts": counts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = collections.Counter(state["counts"])

    def pending_samples(self) -> list[PromptSample]:
        """Prompts started but not finished, and aborted ones waiting to restart (for checkpoints:
        a resumed run starts them again)."""
        return [*self._requeue, *(s for samples in self._in_flight.values() for s in samples)]


def log_dir(run_dir: Path) -> str:
    path = run_dir / "engines"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)
