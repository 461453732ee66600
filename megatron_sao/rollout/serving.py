"""One composition of a rollout: engines (a supervisor), the pool of their clients, the runner.

Every place that rolls the policy out builds the same three parts the same way: the RL pipeline
(`pipeline/rollout_service.py`), value-pretraining corpus generation (`valuepretrain/generate.py`)
and the demo's held-out evaluation (`jobs/demo.py`). `Serving` is that composition:

    serving = Serving(engine_config, agent_config, tokenizer, env_factory, max_inflight_per_engine)
    urls = serving.start_engines()      # blocking until every engine answers; restarted when one dies
    runner = await serving.open()       # on the loop that will use it: pool + runner
    ... runner.iter_trajectories(samples) / runner.run(samples) / run_episodes(runner, samples) ...
    await serving.aclose()              # the runner's gateway (scaffolds), the pool's connections
    serving.stop_engines()

(`async with Serving(...) as serving:` does all four). The runner is always `make_runner`'s pick:
`AgentLoop` for environments stepped turn by turn, `ScaffoldRunner` for scaffold environments
that drive the model themselves through the gateway (`openai_scaffold`). A caller that built an
`AgentLoop` itself would fail every scaffold episode (their `reset` raises TypeError).

The two seams are Protocols: `EngineFleet` (what rollout code needs of the engine processes:
local `EngineSupervisor`, Ray-placed `pipeline.ray_engines.RayEngineSupervisor`) and `Runner`
(what it needs of the agent loop and the scaffold runner).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from megatron_sao.rollout.agent_loop import AgentLoopConfig, AgentLoopStats
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.environment import PromptSample
from megatron_sao.rollout.trajectory import Trajectory

Samples = Iterable[PromptSample] | AsyncIterable[PromptSample]


@runtime_checkable
class EngineFleet(Protocol):
    """The engine servers of a rollout, kept alive: started (healthy), watched and restarted when
    one dies, killed on request (a hung engine), stopped. Index `i` is the i-th URL of `start`."""

    def start(self) -> list[str]:
        """Start every engine; block until each answers; their base URLs."""
        ...

    def start_monitor(self) -> None:
        """Restart engines that die, from now on."""
        ...

    def alive(self, index: int) -> bool: ...

    def kill(self, index: int, sig: int = ...) -> None:
        """Kill engine `index` (the monitor restarts it)."""
        ...

    def total_restarts(self) -> int: ...

    def set_weights(self, model_path: str, weight_version: str) -> None:
        """Engines (re)started from now on load `model_path` as `weight_version` (disk weight sync)."""
        ...

    def stop(self) -> None:
        """Stop every engine and the monitor; nothing it started outlives this call."""
        ...


@runtime_checkable
class Runner(Protocol):
    """Runs episodes on the pool: `AgentLoop` (turn-by-turn environments) or
    `gateway.ScaffoldRunner` (scaffolds behind the gateway). An episode yields one trajectory,
    or one per segment for a scaffold that rewrote its history (`metadata["last_segment"]` marks
    the episode's last)."""

    stats: AgentLoopStats

    def iter_trajectories(self, samples: Samples) -> AsyncIterator[Trajectory]:
        """At most `max_concurrent_trajectories` episodes in flight; trajectories in completion order."""
        ...

    async def run(self, samples: Samples) -> list[Trajectory]: ...

    async def abort(self) -> None:
        """Start no more episodes; running ones end ABORTED."""
        ...


def make_fleet(engine_config: Any, make_supervisor: Callable[[Any], EngineFleet] | None = None) -> EngineFleet:
    """`make_supervisor(engine_config)` (e.g. Ray-placed engines), else local engine processes."""
    if make_supervisor is not None:
        return make_supervisor(engine_config)
    from megatron_sao.rollout.engine_supervisor import EngineSupervisor

    return EngineSupervisor(engine_config)


class Serving:
    """Engines + pool + runner of one rollout (see the module docstring for the order of calls).
    `fleet` is None until the engines start; `pool` and `runner` raise until `open`."""

    def __init__(self, engine_config: Any, agent_config: AgentLoopConfig, tokenizer: Any,
                 env_factory: Callable[[PromptSample], Any], max_inflight_per_engine: int,
                 make_supervisor: Callable[[Any], EngineFleet] | None = None) -> None:
        self.engine_config = engine_config
        self.agent_config = agent_config
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.max_inflight_per_engine = max_inflight_per_engine
        self.make_supervisor = make_supervisor
        self.fleet: EngineFleet | None = None
        self.urls: list[str] = []
        self._pool: EnginePool | None = None
        self._runner: Runner | None = None

    @property
    def pool(self) -> EnginePool:
        if self._pool is None:
            raise RuntimeError("Serving.pool before open()")
        return self._pool

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            raise RuntimeError("Serving.runner before open()")
        return self._runner

    def start_engines(self) -> list[str]:
        """Start the engines (blocking until healthy) and their restart monitor; the URLs."""
        fleet = self.fleet = make_fleet(self.engine_config, self.make_supervisor)
        try:
            self.urls = fleet.start()
            fleet.start_monitor()
        except BaseException:
            self.fleet = None
            fleet.stop()  # the engines that did start end with the failed start
            raise
        return self.urls

    async def open(self) -> Runner:
        """The pool over the engines and the runner that fits the environment, on the running loop
        (the clients' connections belong to it)."""
        from megatron_sao.rollout.client import EngineClient
        from megatron_sao.rollout.gateway.runner import make_runner

        if self.fleet is None:
            raise RuntimeError("Serving.open before start_engines: no engine to pool")
        self._pool = EnginePool([EngineClient(url) for url in self.urls],
                                max_inflight_per_engine=self.max_inflight_per_engine)
        self._runner = make_runner(self.agent_config, self.tokenizer, self._pool, self.env_factory)
        return self._runner

    async def aclose(self) -> None:
        """Close the runner (a scaffold runner's gateway) and the pool; the engines keep running."""
        runner, self._runner = self._runner, None
        close = getattr(runner, "close", None)  # AgentLoop holds nothing to close
        if close is not None:
            await close()
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    def stop_engines(self) -> None:
        fleet, self.fleet = self.fleet, None
        if fleet is not None:
            fleet.stop()

    async def __aenter__(self) -> Serving:
        self.start_engines()
        try:
            await self.open()
        except BaseException:
            await self.aclose()
            self.stop_engines()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.aclose()
        finally:
            self.stop_engines()


def is_last_segment(traj: Trajectory) -> bool:
    """Whether `traj` ends its episode (always, but for the earlier segments of a scaffold episode
    whose history was rewritten: `gateway.runner`)."""
    return traj.metadata.get("last_segment", True) is not False


async def run_episodes(runner: Runner, samples: Sequence[PromptSample]) -> list[Trajectory]:
    """One trajectory per sample, in the order of `samples`: each episode's last segment (it
    carries the episode's status and reward). Samples are told apart by their position, so two
    with the same prompt id are two episodes."""
    key = "serving_index"
    tagged = [dataclasses.replace(s, metadata={**s.metadata, key: i}) for i, s in enumerate(samples)]
    ended: dict[int, Trajectory] = {}
    async for traj in runner.iter_trajectories(tagged):
        index = traj.metadata.pop(key)
        if is_last_segment(traj):
            ended[index] = traj
    missing = [samples[i].prompt_id for i in range(len(samples)) if i not in ended]
    if missing:
        raise RuntimeError(f"the runner ended without an episode for prompts {missing}")
    return [ended[i] for i in range(len(samples))]
