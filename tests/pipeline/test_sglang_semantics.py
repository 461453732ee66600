"""The pipeline against the CPU engine's SGLang 0.5.23 semantics (megatron_sao/cpu_engine: weight-update
session, `/model_info` version, no health answer while paused, memory released only when idle):
the weight-update session and its clean-up after a failure, lagging engines found by their
`/model_info` version, the trainer's update group destroyed on close (registered in torch's c10d
registry as the NCCL path registers it), the health watchdog sparing engines the rollout paused,
and the colocated suspend / resume in 0.5.23's order with a request in flight."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from megatron_sao.config.schema import WeightSyncConfig
from megatron_sao.pipeline.rollout_service import RolloutService
from megatron_sao.pipeline.weight_sync import WeightSync, WeightSyncError
from megatron_sao.rollout.client import EngineClient, SamplingParams
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.weight_transfer import DEFAULT_GROUP_NAME
from tests.pipeline.test_weight_sync import CheckpointExporter
from tests.rollout.engine_helpers import cpu_engine, tiny_checkpoint_other_seed

PROMPT = list(range(10, 40))


class KillRecorder:
    """The watchdog's view of an engine supervisor: every engine process alive; kills recorded
    (the engines here are in-process servers, not processes to kill)."""

    def __init__(self) -> None:
        self.killed: list[int] = []

    def alive(self, index: int) -> bool:
        return True

    def kill(self, index: int, sig: int = 9) -> None:
        self.killed.append(index)

    def total_restarts(self) -> int:
        return 0


def _service(urls: list[str], supervisor: Any = None, **health: float) -> RolloutService:
    """A `RolloutService` over running engines: its loop, pool and (with `supervisor`) watchdog,
    without an agent loop."""
    service = RolloutService(None, None, None, None, iter(()), None, max_inflight_per_engine=4, **health)
    service.supervisor = supervisor
    service._thread.start()

    async def build() -> None:
        service.pool = EnginePool([EngineClient(u) for u in urls], max_inflight_per_engine=4)

    service.run(build())
    if supervisor is not None:
        service._watchdog = asyncio.run_coroutine_threadsafe(service._watch(), service._loop)
    return service


def _close(service: RolloutService) -> None:
    service._stopping = True
    if service._watchdog is not None:
        service._watchdog.cancel()
    service.run(service.pool.close(), timeout_s=30)
    service._loop.call_soon_threadsafe(service._loop.stop)
    service._thread.join(timeout=30)


def test_a_failed_push_ends_its_session_and_the_next_push_lands():
    exporter = CheckpointExporter(tiny_checkpoint_other_seed())
    broken = CheckpointExporter(tiny_checkpoint_other_seed())
    broken.tensors = {**broken.tensors, "model.layers.0.not_a_weight": torch.zeros(2)}
    with cpu_engine() as server:
        async def go():
            client = EngineClient(server.url)
            with pytest.raises(WeightSyncError, match="unknown"):
                await WeightSync(broken, WeightSyncConfig(mode="tensor", bucket_mb=1000)).push([client], 1)
            report = await WeightSync(exporter, WeightSyncConfig(mode="tensor", bucket_mb=0.2)).push([client], 2)
            return report, await client.get_weight_version()

        report, version = asyncio.run(go())
        assert server.engine.weight_session is None  # every session opened was closed
    assert version == "2" and report.num_buckets > 1


def test_lagging_engines_are_found_by_their_model_info_version():
    with cpu_engine() as a, cpu_engine() as b:
        service = _service([a.url, b.url])
        try:
            first = next(c for c in service.pool.clients if c.base_url == a.url)
            service.run(first.update_weight_version("3"))  # as a push leaves it; b stays at "0"
            lagging = service.lagging_clients("3")
        finally:
            _close(service)
    assert [c.base_url for c in lagging] == [b.url]


def test_the_trainer_end_of_the_update_group_is_destroyed_on_close_and_reopens():
    from torch.distributed.distributed_c10d import _world

    exporter = CheckpointExporter(tiny_checkpoint_other_seed())
    with cpu_engine() as server:
        async def go():
            clients = [EngineClient(server.url)]
            sync = WeightSync(exporter, WeightSyncConfig(mode="distributed", bucket_mb=0.5), timeout_s=60)
            await sync._ensure_group(clients)  # what a distributed push opens first
            registered = DEFAULT_GROUP_NAME in _world.pg_names.values()  # as torch registers NCCL groups
            assert registered, "the trainer's end of the group is not in torch's c10d registry (GPU's NCCL one is)"
            await sync.close_group(clients)
            closed = DEFAULT_GROUP_NAME in _world.pg_names.values()
            await sync.push(clients, 2)  # opens the same name again: torch refuses unless the old one is gone
            await sync.close_group(clients)
            return registered, closed, await clients[0].get_weight_version()

        assert asyncio.run(go()) == (True, False, "2")
        assert server.engine.groups == {}


@pytest.mark.timeout(300)
def test_the_watchdog_spares_engines_the_rollout_paused(monkeypatch):
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.5")  # the engine's probe gives up after 0.5 s
    supervisor = KillRecorder()
    with cpu_engine() as server:
        service = _service([server.url], supervisor, health_interval_s=0.2, health_timeout_s=5.0,
                           health_failures=2)
        try:
            paused = service.pause_for_update(service.pool.clients)
            time.sleep(3.0)  # several checks' worth: each would fail while paused
            spared = list(supervisor.killed)
            service.continue_after_update(paused)
            # paused behind the rollout's back, the same checks fail and the engine is killed
            asyncio.run(EngineClient(server.url).pause_generation("in_place"))
            deadline = time.monotonic() + 30
            while not supervisor.killed and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            _close(service)
    assert spared == [] and supervisor.killed[:1] == [0]


@pytest.mark.timeout(300)
def test_colocated_suspend_and_resume_follow_sglangs_order_with_a_request_in_flight():
    """retract + release (the engine is idle, as 0.5.23 asserts), the trainer's turn, the weights
    back, the push, the rest back, continue: the request in flight survives and its later tokens
    carry the new version. Releasing after an in-place pause, or pushing into released weights,
    would stop the engine (megatron_sao/cpu_engine/occupation.py)."""
    exporter = CheckpointExporter(tiny_checkpoint_other_seed())
    with cpu_engine() as server:
        service = _service([server.url])
        try:
            client = service.pool.clients[0]
            params = SamplingParams(max_new_tokens=400, ignore_eos=True)
            request = asyncio.run_coroutine_threadsafe(client.generate(PROMPT, params), service._loop)
            while server.engine.scheduler.stats.generated_tokens < 10:
                time.sleep(0.01)
            service.suspend()
            released = set(server.engine.scheduler.memory.released)
            service.resume_weights()
            with service.paused(service.pool.healthy_clients()) as paused:
                report = service.run(WeightSync(exporter, WeightSyncConfig(mode="tensor", bucket_mb=1)).push(paused, 5))
            service.resume()
            out = request.result(timeout=120)
        finally:
            _close(service)
        assert server.engine.scheduler.alive and server.engine.scheduler.memory.released == set()
    assert released == {"kv_cache", "weights", "cuda_graph"} and report.version == "5"
    assert out.finish_reason.type == "length" and len(out.output_ids) == 400
    versions = out.token_versions()
    assert versions[0] == "0" and versions[-1] == "5" and set(versions) == {"0", "5"}
