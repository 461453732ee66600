"""`ScaffoldRunner`: the agent loop's counterpart for environments that drive the model themselves.

`AgentLoop` steps an `Environment` turn by turn; a scaffold behind the gateway (`openai_scaffold`)
runs its own loop and calls the model over HTTP. The runner has the agent loop's constructor and
interface (`iter_trajectories`, `run`, `abort`, `stats`), so the pipeline can hold either
(`make_runner` picks): per prompt it opens a gateway session, runs the environment's
`run_episode(sample, session_url, model)` (the scaffold process and its verifier), closes the
session and turns what the session recorded into trajectories.

Episodes and segments: an episode yields one trajectory per segment (normally one; more when the
scaffold rewrote its history, `session.py`), in order, each with `metadata["episode_id"]`,
`["segment"]`, `["num_segments"]` and `["last_segment"]`. All segments of an episode share its
status and its terminal reward, credited to each segment's last action token: with gamma = 1
every action token's return is the episode's reward, as if the episode were one trajectory.
Status: the environment's failure (scaffold crash / timeout, verifier error) or an engine failure
-> FAILED with the reason; a gateway limit hit (max_total_tokens / max_turns) -> TRUNCATED, scored
by the verifier when the scaffold still finished cleanly, else `truncation_reward`; `abort()` ->
ABORTED; else COMPLETED with the verifier's reward. A scaffold that never called the model yields
one empty FAILED trajectory ("no_model_call"), so every prompt is accounted for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any

from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig, AgentLoopStats
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.environment import PromptSample
from megatron_sao.rollout.gateway.server import Gateway, GatewayConfig
from megatron_sao.rollout.gateway.session import GatewaySession
from megatron_sao.rollout.gateway.types import SessionLimits
from megatron_sao.rollout.trajectory import RewardKind, Trajectory, TrajectoryStatus

logger = logging.getLogger(__name__)


def limits_from(config: AgentLoopConfig) -> SessionLimits:
    """The agent loop's limits and sampling, applied to scaffold sessions (RL samples at the run's
    temperature / top_p whatever the scaffold asks for)."""
    return SessionLimits(max_total_tokens=config.max_total_tokens, max_turns=config.max_turns,
                         max_new_tokens_per_turn=config.max_new_tokens_per_turn, temperature=config.temperature,
                         top_p=config.top_p, max_engine_retries=config.max_engine_retries)


class ScaffoldRunner:
    def __init__(self, config: AgentLoopConfig, tokenizer: Any, pool: EnginePool,
                 env_factory: Callable[[PromptSample], Any], gateway_config: GatewayConfig | None = None) -> None:
        self.config = config
        self.pool = pool
        self.env_factory = env_factory
        gateway_config = gateway_config or GatewayConfig(**getattr(env_factory, "gateway_options", {}))
        if gateway_config.stop_token_ids is None:
            gateway_config.stop_token_ids = config.stop_token_ids
        gateway_config.limits = limits_from(config)
        self.gateway = Gateway(pool, tokenizer, gateway_config)
        self.stats = AgentLoopStats()
        self._started = False
        self._aborting = False
        self._abort_event: asyncio.Event | None = None

    async def start(self) -> str:
        if not self._started:
            await self.gateway.start()
            self._started = True
        return self.gateway.url

    async def close(self) -> None:
        if self._started:
            await self.gateway.stop()
            self._started = False

    # ---- many episodes ------------------------------------------------------------------------

    async def iter_trajectories(
        self, samples: Iterable[PromptSample] | AsyncIterable[PromptSample]
    ) -> AsyncIterator[Trajectory]:
        """Episodes with at most `max_concurrent_trajectories` in flight; each episode's segments
        are yielded together, the moment it finishes."""
        await self.start()
        source = aiter(samples) if isinstance(samples, AsyncIterable) else None
        sync_source = None if source is not None else iter(samples)  # type: ignore[arg-type]
        pending: set[asyncio.Task[list[Trajectory]]] = set()
        exhausted = False
        try:
            while True:
                while not exhausted and not self._aborting and len(pending) < self.config.max_concurrent_trajectories:
                    sample = await anext(source, None) if source is not None else next(sync_source, None)  # type: ignore[arg-type]
                    if sample is None:
                        exhausted = True
                        break
                    pending.add(asyncio.create_task(self.run_episode(sample)))
                if not pending:
                    return
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    for traj in task.result():
                        yield traj
        finally:
            for task in pending:
                task.cancel()

    async def run(self, samples: Iterable[PromptSample] | AsyncIterable[PromptSample]) -> list[Trajectory]:
        return [traj async for traj in self.iter_trajectories(samples)]

    async def abort(self) -> None:
        """Start no episode; running ones end ABORTED (their scaffolds are killed)."""
        self._aborting = True
        self._event().set()
        for session in list(self.gateway.sessions.values()):
            session.abort()
        await self.pool.abort_all()

    def _event(self) -> asyncio.Event:
        if self._abort_event is None:
            self._abort_event = asyncio.Event()
        return self._abort_event

    # ---- one episode --------------------------------------------------------------------------

    async def run_episode(self, sample: PromptSample) -> list[Trajectory]:
        started = time.time()
        session = self.gateway.open_session(sample.prompt_id, sample.metadata)
        status, reason, reward, info = TrajectoryStatus.FAILED, "", None, {}
        try:
            env = self.env_factory(sample)
            if not callable(getattr(env, "run_episode", None)):
                raise TypeError(f"{type(env).__name__} is not a scaffold environment (no run_episode); "
                                "use AgentLoop for turn-by-turn environments")
            episode = asyncio.ensure_future(env.run_episode(sample, self.gateway.session_url(session),
                                                            self.gateway.config.model_name))
            aborted = asyncio.ensure_future(self._event().wait())
            await asyncio.wait({episode, aborted}, return_when=asyncio.FIRST_COMPLETED)
            aborted.cancel()
            if not episode.done():
                episode.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await episode
                status, reason = TrajectoryStatus.ABORTED, "aborted"
            else:
                outcome = episode.result()
                info = {"exit_code": outcome.exit_code, "scaffold_s": round(outcome.scaffold_s, 6),
                        "verifier_s": round(outcome.verifier_s, 6), **outcome.info}
                status, reason, reward = self._judge(session, outcome.failure, outcome.reward)
        except Exception as e:  # a bug must cost one episode, not the rollout
            logger.exception("episode of prompt %s failed unexpectedly", sample.prompt_id)
            status, reason = TrajectoryStatus.FAILED, f"internal_error: {e!r}"
        finally:
            self.gateway.close_session(session)
        trajs = self._finish(session, sample, started, status, reason, reward, info)
        for traj in trajs:
            self.stats.record(traj)
        return trajs

    def _judge(self, session: GatewaySession, failure: str | None,
               reward: float | None) -> tuple[TrajectoryStatus, str, float | None]:
        if session.aborted or self._aborting:
            return TrajectoryStatus.ABORTED, "aborted", None
        if session.failure:
            return TrajectoryStatus.FAILED, session.failure, None
        if not session.segments:  # nothing sampled: nothing to train on, whatever else happened
            if session.limit_reason:
                return TrajectoryStatus.FAILED, f"prompt_too_long: {session.limit_reason}", None
            return TrajectoryStatus.FAILED, failure or "no_model_call: the scaffold never called the model", None
        if session.limit_reason:  # the scaffold may have crashed on the 400: the limit is why
            scored = self.config.truncation_reward if failure else reward
            return TrajectoryStatus.TRUNCATED, session.limit_reason, scored
        if failure:
            return TrajectoryStatus.FAILED, failure, None
        return TrajectoryStatus.COMPLETED, "done", reward

    def _finish(self, session: GatewaySession, sample: PromptSample, started: float, status: TrajectoryStatus,
                reason: str, reward: float | None, info: dict[str, Any]) -> list[Trajectory]:
        trajs = list(session.segments)
        if not trajs:
            metadata = {**sample.metadata, "episode_id": session.session_id, "segment": 0}
            empty = Trajectory(prompt_id=sample.prompt_id, metadata=metadata)
            empty.timings.started_at = started
            trajs = [empty]
        now = time.time()
        for i, traj in enumerate(trajs):
            traj.metadata.update(num_segments=len(trajs), last_segment=i == len(trajs) - 1, scaffold=info)
            if reward is not None and traj.turns and status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED):
                traj.add_reward(reward, RewardKind.TERMINAL)
            traj.finish(status, reason)
            traj.timings.finished_at = now
        return trajs


def make_runner(config: AgentLoopConfig, tokenizer: Any, pool: EnginePool, env_factory: Callable[[PromptSample], Any],
                gateway_config: GatewayConfig | None = None) -> AgentLoop | ScaffoldRunner:
    """`ScaffoldRunner` for a scaffold environment factory (`driven_by_gateway`), else `AgentLoop`."""
    if getattr(env_factory, "driven_by_gateway", False):
        return ScaffoldRunner(config, tokenizer, pool, env_factory, gateway_config)
    return AgentLoop(config, tokenizer, pool, env_factory)
