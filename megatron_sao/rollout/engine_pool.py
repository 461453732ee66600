"""Routing generate calls over several engines, and riding out engine crashes.

The agent loop asks the pool for an engine for every generate call (not once per trajectory):
multi-turn trajectories then spread over the engines by load, and a call that fails because its
engine died is simply re-sent to another (or the same, restarted) engine. The pool marks an
engine down on `EngineUnavailableError` and probes it with `/health_generate` until it answers
again (the launcher restarts crashed engines on the same address), then routes to it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from megatron_sao.rollout.client import EngineClient

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _EngineState:
    client: EngineClient
    inflight: int = 0
    healthy: bool = True
    probe: asyncio.Task | None = None


class EnginePool:
    """Least-loaded routing over `clients`, at most `max_inflight_per_engine` calls each."""

    def __init__(
        self,
        clients: Sequence[EngineClient],
        max_inflight_per_engine: int = 256,
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 30.0,
    ) -> None:
        if not clients:
            raise ValueError("an EnginePool needs at least one engine")
        if max_inflight_per_engine < 1:
            raise ValueError(f"max_inflight_per_engine must be >= 1, got {max_inflight_per_engine}")
        self._engines = [_EngineState(c) for c in clients]
        self.max_inflight_per_engine = max_inflight_per_engine
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._changed: asyncio.Condition | None = None

    @property
    def clients(self) -> list[EngineClient]:
        return [e.client for e in self._engines]

    def healthy_clients(self) -> list[EngineClient]:
        return [e.client for e in self._engines if e.healthy]

    def inflight(self) -> dict[str, int]:
        return {e.client.base_url: e.inflight for e in self._engines}

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _pick(self) -> _EngineState | None:
        candidates = [e for e in self._engines if e.healthy and e.inflight < self.max_inflight_per_engine]
        return min(candidates, key=lambda e: e.inflight) if candidates else None

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[EngineClient]:
        """Wait for a healthy engine with a free slot; hold the slot for the `async with` body."""
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self._pick() is not None)
            state = self._pick()
            assert state is not None
            state.inflight += 1
        try:
            yield state.client
        finally:
            async with cond:
                state.inflight -= 1
                cond.notify_all()

    async def mark_unhealthy(self, client: EngineClient) -> None:
        """Stop routing to `client` and probe it until it is healthy again."""
        state = next(e for e in self._engines if e.client is client)
        if not state.healthy:
            return
        logger.warning("engine %s is unavailable; re-routing its calls and probing it", client.base_url)
        state.healthy = False
        state.probe = asyncio.get_running_loop().create_task(self._probe(state))

    async def _probe(self, state: _EngineState) -> None:
        while not await state.client.health_generate(timeout_s=self.probe_timeout_s):
            await asyncio.sleep(self.probe_interval_s)
        logger.info("engine %s is healthy again", state.client.base_url)
        cond = self._condition()
        async with cond:
            state.healthy = True
            state.probe = None
            cond.notify_all()

    async def abort_all(self) -> None:
        """`/abort_request {abort_all: true}` on every healthy engine (errors are logged)."""

        async def one(client: EngineClient) -> None:
            try:
                await client.abort_request(abort_all=True)
            except Exception as e:  # an engine that is down has nothing in flight to abort
                logger.warning("abort on %s failed: %r", client.base_url, e)

        await asyncio.gather(*(one(c) for c in self.healthy_clients()))

    async def close(self) -> None:
        for state in self._engines:
            if state.probe is not None:
                state.probe.cancel()
            await state.client.close()
