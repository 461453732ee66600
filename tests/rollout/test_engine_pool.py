"""EnginePool routing: least-loaded engine, capacity limits, and an unavailable engine taken out
of rotation until its health probe passes again."""

from __future__ import annotations

import asyncio

import pytest

from megatron_sao.rollout.engine_pool import EnginePool


class FakeClient:
    def __init__(self, name: str) -> None:
        self.base_url = name
        self.healthy = True
        self.probes = 0
        self.aborts = 0

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        self.probes += 1
        return self.healthy

    async def abort_request(self, rid=None, abort_all=False) -> None:
        self.aborts += 1

    async def close(self) -> None:
        return None


def test_routes_to_the_least_loaded_engine_within_capacity():
    a, b = FakeClient("a"), FakeClient("b")
    pool = EnginePool([a, b], max_inflight_per_engine=2)

    async def go():
        held = []
        picked = []
        for _ in range(4):
            cm = pool.acquire()
            picked.append((await cm.__aenter__()).base_url)
            held.append(cm)
        fifth = asyncio.create_task(pool.acquire().__aenter__())
        await asyncio.sleep(0.05)
        blocked = not fifth.done()  # both engines are at capacity
        await held[0].__aexit__(None, None, None)
        freed = (await asyncio.wait_for(fifth, 1)).base_url
        return picked, blocked, freed

    picked, blocked, freed = asyncio.run(go())
    assert sorted(picked) == ["a", "a", "b", "b"] and sorted(picked[:2]) == ["a", "b"]
    assert blocked and freed == picked[0]


def test_unhealthy_engine_is_skipped_until_its_probe_passes():
    a, b = FakeClient("a"), FakeClient("b")
    pool = EnginePool([a, b], probe_interval_s=0.01)

    async def go():
        a.healthy = False
        await pool.mark_unhealthy(a)
        routed = []
        for _ in range(5):
            async with pool.acquire() as client:
                routed.append(client.base_url)
        await asyncio.sleep(0.05)
        probes_while_down = a.probes
        still_down = [c.base_url for c in pool.healthy_clients()]
        a.healthy = True
        await asyncio.sleep(0.1)
        await pool.abort_all()
        return routed, probes_while_down, still_down, [c.base_url for c in pool.healthy_clients()]

    routed, probes, still_down, healthy = asyncio.run(go())
    assert routed == ["b"] * 5 and probes >= 2 and still_down == ["b"]
    assert healthy == ["a", "b"] and a.aborts == b.aborts == 1


def test_pool_needs_engines():
    with pytest.raises(ValueError, match="at least one"):
        EnginePool([])
