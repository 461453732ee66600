"""The rollout actor's boundary (`pipeline/rollout_actor.py`) without Ray: a weight push made on
"rank 0" against `RemoteEngine` stand-ins reaches real CPU engines through `RolloutActor.engine_call`
(the actor's own clients, on its own loop), in every mode; errors come back as themselves. The
whole path under Ray is `tests/pipeline/test_ray_placement.py`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from types import SimpleNamespace

import pytest

from megatron_sao.config.schema import WeightSyncConfig
from megatron_sao.pipeline.rollout_actor import ENGINE_CALLS, RemoteEngine, RolloutActor
from megatron_sao.pipeline.weight_sync import WeightSync, WeightSyncError
from megatron_sao.rollout.client import EngineClient, EngineError, EngineUnavailableError
from tests.pipeline.test_weight_sync import GREEDY, PROMPT, CheckpointExporter
from tests.rollout.engine_helpers import cpu_engine, tiny_checkpoint_other_seed


class _Loop:
    """The actor's side: engine clients living on a loop thread of their own (as in the actor)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class _Handle:
    """A Ray actor handle's shape: `handle.method.remote(...)` -> a ref with `.future()`; each call
    runs on a thread of a pool (a threaded actor)."""

    def __init__(self, target, pool: concurrent.futures.Executor, wrap=None) -> None:
        self.target, self.pool, self.wrap = target, pool, wrap

    def __getattr__(self, name):
        def remote(*args, **kwargs):
            def call():
                try:
                    return getattr(self.target, name)(*args, **kwargs)
                except Exception as error:
                    raise (self.wrap(error) if self.wrap else error) from None
            future = self.pool.submit(call)
            return SimpleNamespace(future=lambda: future)
        return SimpleNamespace(remote=remote)


class _RayTaskError(RuntimeError):
    """What Ray raises for an error in an actor method: the original one in `cause`."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(f"remote traceback ... {cause!r}")
        self.cause = cause


def _actor(urls: list[str], loop: _Loop) -> RolloutActor:
    actor = object.__new__(RolloutActor)  # just the forwarding, over a stand-in service
    actor.service = SimpleNamespace(pool=SimpleNamespace(clients=[EngineClient(u) for u in urls]), run=loop.run)
    return actor


@pytest.mark.parametrize("mode", ["tensor", "disk", "distributed"])
def test_a_push_through_the_actor_reaches_the_engines(mode, tmp_path):
    exporter = CheckpointExporter(tiny_checkpoint_other_seed())
    config = WeightSyncConfig(mode=mode, bucket_mb=0.05, checksum=True)
    loop = _Loop()
    with cpu_engine() as server, concurrent.futures.ThreadPoolExecutor(8) as pool:
        handle = _Handle(_actor([server.url], loop), pool, wrap=_RayTaskError)
        engines = [RemoteEngine(handle, server.url)]
        sync = WeightSync(exporter, config, disk_dir=str(tmp_path / "sync"))
        report = asyncio.run(sync.push(engines, 5))  # rank 0's own loop, not the actor's
        asyncio.run(sync.close_group(engines))
        direct = EngineClient(server.url)
        out = asyncio.run(direct.generate(PROMPT, GREEDY))
    loop.close()
    assert report.engines == [server.url] and report.num_tensors == len(exporter.tensors)
    assert report.checksum is not None and out.weight_version == "5"


def test_remote_engine_forwards_only_weight_push_calls_and_raises_the_engines_error():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        class Refusing:
            def engine_call(self, url, method, args, kwargs):
                if method == "flush_cache":
                    raise KeyError("not an engine's error")
                return {"engine_error": (method == "get_weight_version", url, f"{method} refused", 400)}

        engine = RemoteEngine(_Handle(Refusing(), pool, wrap=_RayTaskError), "http://engine:1")
        with pytest.raises(EngineError, match="update_weight_version refused") as info:
            asyncio.run(engine.update_weight_version("3", abort_all_requests=False))
        assert type(info.value) is EngineError and info.value.status_code == 400
        with pytest.raises(EngineUnavailableError, match="get_weight_version refused"):
            asyncio.run(engine.get_weight_version())
        with pytest.raises(KeyError):  # Ray's wrapper taken off
            asyncio.run(engine.flush_cache())
    with pytest.raises(AttributeError):
        engine.generate  # noqa: B018  (generation is the actor's own business)
    assert {"update_weights_from_tensor", "update_weights_from_distributed", "update_weights_from_disk"} <= ENGINE_CALLS
    actor = _actor(["http://engine:1"], loop=SimpleNamespace(run=None))
    with pytest.raises(ValueError, match="not forwarded"):
        actor.engine_call("http://engine:1", "pause_generation", (), {})


def test_push_errors_name_the_engine_through_the_actor():
    exporter = CheckpointExporter(tiny_checkpoint_other_seed())
    exporter.tensors["model.layers.0.not_a_weight"] = exporter.tensors[next(iter(exporter.tensors))][:2].clone()
    loop = _Loop()
    with cpu_engine() as server, concurrent.futures.ThreadPoolExecutor(4) as pool:
        engines = [RemoteEngine(_Handle(_actor([server.url], loop), pool, wrap=_RayTaskError), server.url)]
        with pytest.raises(WeightSyncError) as info:
            asyncio.run(WeightSync(exporter, WeightSyncConfig(mode="tensor", bucket_mb=1000)).push(engines, 1))
    loop.close()
    assert server.url in str(info.value) and "update_weights_from_tensor" in str(info.value)
    assert "remote traceback" not in str(info.value)  # the engine's own error, not Ray's wrapper
