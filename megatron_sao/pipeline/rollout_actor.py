"""The rollout of a run (prompt stream, ready buffer, `RolloutService`: engine supervisor, agent
loop, health watchdog) behind one interface, in trainer rank 0's process or in a Ray actor.

`RolloutHost` builds and holds the three; `EngineSource` (trainer rank 0, the only trainer rank
that talks to the rollout) calls it: `start`, `take` (a batch of ready trajectories), `suspend` /
`resume` (colocated), `metrics`, `lagging_urls`, the weight-push calls (`healthy_clients`,
`paused`, `run`, `set_weights`), `start_eval` / `eval_results` (evaluation during training,
`pipeline/evaluation.py`), `state_dict` / `load_state_dict` (checkpoints) and `stop`.

Without Ray (`launcher.ray=false`) rank 0 builds a `RolloutHost` itself: the agent loop runs on a
thread of rank 0, as it always did. With `launcher.ray=true` it runs in a `RolloutActor` of its
own, in the run's placement group (its own CPU bundle, `pipeline/placement.py`), and rank 0 holds
a `RemoteRollout`: the same methods, each one Ray call (`ray.get`). The engines' host actors are
the rollout actor's children (it supervises and restarts them); the actor is rank 0's child, so
it goes when rank 0 goes.

Weight sync across the boundary: the collective stream and `WeightSync.push` stay on rank 0 (the
trainer ranks' exporter is there). Rank 0 asks the actor to pause the engines in place, then runs
the push on a loop of its own against `RemoteEngine`s: one per paused engine, each engine call
(`update_weights_from_tensor`, `update_weight_version`, ...) forwarded to the actor's client of
that engine (`RolloutActor.engine_call`), so every HTTP call to an engine is made by the rollout
actor. What each mode moves through it:

- `tensor`: the bucket payloads (safetensors bytes on CPU; CUDA IPC handles for SGLang, the
  tensors stay alive on rank 0 until the call returns) go through Ray's object store;
- `distributed`: only the announcements (`init_weights_update_group`,
  `update_weights_from_distributed`); the tensors go from rank 0 to the engines over the process
  group, as without Ray;
- `disk`: rank 0 writes the HF directory (shared storage, as without Ray); the actor tells the
  engines to load it and its engine supervisor to start restarted engines from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from megatron_sao.config.schema import SaoConfig

if TYPE_CHECKING:
    from megatron_sao.rollout.serving import EngineFleet

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The engine calls a weight push makes (`pipeline/weight_sync.py`); the only ones forwarded.
ENGINE_CALLS = frozenset({"begin_weight_update", "end_weight_update",
                          "update_weights_from_tensor", "update_weights_from_distributed", "update_weights_from_disk",
                          "init_weights_update_group", "destroy_weights_update_group", "update_weight_version",
                          "get_weight_version", "flush_cache"})


class RolloutHost:
    """Prompt stream + ready buffer + `RolloutService` of one run, built from its config."""

    def __init__(self, config: SaoConfig, run_dir: Path | str,
                 make_supervisor: Callable[[Any], EngineFleet] | None = None) -> None:
        from transformers import AutoTokenizer

        from megatron_sao.pipeline.buffer import ReadyBuffer, round_gated
        from megatron_sao.pipeline.prompts import PromptStream, positioned
        from megatron_sao.pipeline.rollout_service import RolloutService, log_dir
        from megatron_sao.rollout.datasets import DatasetConfig, load_prompts
        from megatron_sao.rollout.settings import agent_loop_config_from, engine_config_from, env_factory_from

        c = config
        dataset = load_prompts(c.data.train_path, DatasetConfig(max_prompt_chars=c.data.max_prompt_chars))
        logger.info("prompts: %s (%s)", c.data.train_path, dataset.report.summary())
        self.prompts = PromptStream(dataset.samples, shuffle=c.data.shuffle, seed=c.run.seed,
                                    group_size=c.algorithm.group_size)
        p = c.pipeline
        self.buffer = ReadyBuffer(group_size=c.algorithm.group_size, max_staleness=c.algorithm.max_staleness,
                                  staleness_check=p.staleness_check, stale_policy=p.stale_policy,
                                  max_buffered=p.max_buffered or 2 * c.data.batch_size,
                                  distinct_prompts=p.distinct_prompts, barrier=p.barrier)
        env_factory = self._eval_env_factory = env_factory_from(c)
        if p.barrier:  # each environment's reset waits for a permit of the round the trainer opened
            env_factory = round_gated(env_factory, self.buffer)
        engine_config = engine_config_from(c)
        engine_config.log_dir = log_dir(Path(run_dir))
        self.service = RolloutService(
            engine_config, agent_loop_config_from(c), AutoTokenizer.from_pretrained(c.model.hf_path),
            env_factory, positioned(self.prompts), self.buffer,
            max_inflight_per_engine=c.rollout.max_inflight_per_engine, health_interval_s=p.engine_health_interval_s,
            health_timeout_s=p.engine_health_timeout_s, health_failures=p.engine_health_failures,
            make_supervisor=make_supervisor)
        self._config = c
        self.evaluator: Any = None
        """Evaluation during training (`pipeline/evaluation.py`), built once the engines are up."""

    @property
    def num_prompts(self) -> int:
        return len(self.prompts.samples)

    def start(self) -> list[str]:
        """Start the engines (healthy) and the agent loop; returns the engine URLs."""
        from megatron_sao.pipeline.evaluation import make_evaluator

        urls = self.service.start()
        self.evaluator = make_evaluator(self._config, self.service.tokenizer, self.service.pool, self.service.submit,
                                        self._eval_env_factory)
        return urls

    def start_eval(self, step: int, actor_version: int) -> bool:
        """Start evaluating the current policy on the held-out prompts (False: one is running)."""
        return self.evaluator.start(step, actor_version) if self.evaluator is not None else False

    def eval_results(self, wait_s: float = 0.0) -> list[dict[str, float]]:
        """Metrics of the evaluations finished since the last call (waiting up to `wait_s`)."""
        return self.evaluator.finished(wait_s) if self.evaluator is not None else []

    def take(self, batch_size: int, actor_version: int, timeout_s: float) -> list[Any] | None:
        """`batch_size` ready trajectories, or None if none within `timeout_s`; raises if the
        rollout stopped."""
        self.service.raise_if_failed()
        return self.buffer.take(batch_size, actor_version, timeout_s=timeout_s)

    def suspend(self) -> None:
        self.service.suspend()

    def resume_weights(self) -> None:
        self.service.resume_weights()

    def resume(self) -> None:
        self.service.resume()

    def metrics(self) -> dict[str, float]:
        """The accounting, the engines, the buffer and the prompt stream's epoch."""
        return {**self.service.metrics(), **self.buffer.metrics(), "data/epoch": self.prompts.epochs_done}

    def lagging_urls(self, version: str) -> list[str]:
        return [c.base_url for c in self.service.lagging_clients(version)]

    # ---- a weight push: pause the clients, run `WeightSync.push` against them, continue ---------

    def healthy_clients(self) -> list[Any]:
        return self.service.healthy_clients()

    def paused(self, clients: list[Any]) -> contextlib.AbstractContextManager[list[Any]]:
        return self.service.paused(clients)

    def run(self, coro: Awaitable[T]) -> T:
        """Run `coro` where the engine clients live (the rollout thread's loop)."""
        return self.service.run(coro)

    def set_weights(self, model_path: str, weight_version: str) -> None:
        """Engines restarted from now on load `model_path` (disk weight sync)."""
        self.service.supervisor.set_weights(model_path, weight_version)

    # ---- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Prompt position (with the unfinished prompts, handed out first on resume), buffer
        contents and the accounting."""
        return {"prompts": self.prompts.state_dict(unfinished=self.service.pending_samples()),
                "buffer": self.buffer.state_dict(), "rollout": self.service.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.buffer.load_state_dict(state["buffer"])
        self.service.load_state_dict(state["rollout"])

    def stop(self) -> None:
        if self.evaluator is not None:
            self.evaluator.stop()
        self.service.stop()


class RolloutActor(RolloutHost):
    """`RolloutHost` as a Ray actor (threaded: the engine calls of one weight push run at once).
    The engine hosts are created from here, in the run's placement group (`make_supervisor`)."""

    def __init__(self, config: SaoConfig, run_dir: str, make_supervisor: Callable[[Any], EngineFleet] | None) -> None:
        from megatron_sao.utils.lifetime import lead_process_group

        lead_process_group()  # environment processes, reward pools: they end with this actor's worker
        logging.basicConfig(level=logging.INFO, force=True,
                            format="%(asctime)s [rollout] %(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per engine request otherwise
        super().__init__(config, run_dir, make_supervisor)

    def info(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "num_prompts": self.num_prompts}

    def healthy_urls(self) -> list[str]:
        return [c.base_url for c in self.service.healthy_clients()]

    def _clients(self, urls: list[str]) -> list[Any]:
        return [c for c in self.service.pool.clients if c.base_url in urls]

    def pause(self, urls: list[str]) -> list[str]:
        """Pause these engines in place for a weight update; returns the URLs that paused."""
        return [c.base_url for c in self.service.pause_for_update(self._clients(urls))]

    def unpause(self, urls: list[str]) -> None:
        self.service.continue_after_update(self._clients(urls))

    def engine_call(self, url: str, method: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """One engine call of a weight push made on rank 0, on this actor's client of `url`:
        {"result": ...} or, when the engine refused or could not be reached, {"engine_error": ...}
        (`EngineError`s do not survive pickling; `RemoteEngine` raises them again)."""
        from megatron_sao.rollout.engine_protocol import EngineError, EngineUnavailableError

        if method not in ENGINE_CALLS:
            raise ValueError(f"engine call {method!r} is not forwarded (only {sorted(ENGINE_CALLS)})")
        clients = self._clients([url])
        if not clients:
            raise ValueError(f"no engine at {url}")
        try:
            return {"result": self.service.run(getattr(clients[0], method)(*args, **kwargs))}
        except EngineError as e:
            return {"engine_error": (isinstance(e, EngineUnavailableError), e.url, e.message, e.status_code)}


class RemoteEngine:
    """Rank 0's stand-in for one engine client during a weight push: each call a `RolloutActor.
    engine_call`; an engine's error is raised here as itself (`EngineError`,
    `EngineUnavailableError`), any other as Ray's error's cause where it has one."""

    def __init__(self, actor: Any, base_url: str) -> None:
        self.actor = actor
        self.base_url = base_url

    def __repr__(self) -> str:
        return f"RemoteEngine({self.base_url!r})"

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name not in ENGINE_CALLS:
            raise AttributeError(name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            from megatron_sao.rollout.engine_protocol import EngineError, EngineUnavailableError

            ref = self.actor.engine_call.remote(self.base_url, name, args, kwargs)
            try:
                answer = await asyncio.wrap_future(ref.future())
            except Exception as error:
                cause = getattr(error, "cause", None)  # ray.exceptions.RayTaskError
                if isinstance(cause, Exception):
                    raise cause from None
                raise
            if "engine_error" in answer:
                unavailable, url, message, status = answer["engine_error"]
                raise (EngineUnavailableError if unavailable else EngineError)(url, message, status)
            return answer["result"]

        return call


class RemoteRollout:
    """Trainer rank 0's handle on a `RolloutActor` in bundle `bundle` of `placement_group`: the
    `RolloutHost` interface, one Ray call per method."""

    def __init__(self, config: SaoConfig, run_dir: Path | str, placement_group: Any, bundle: int,
                 make_supervisor: Callable[[Any], EngineFleet] | None, num_cpus: float = 1.0) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=placement_group,
                                                    placement_group_bundle_index=bundle)
        # Threads for the calls that may be in flight at once: one per engine during a push, plus
        # the odd metrics / state call.
        concurrency = 16 + 2 * config.rollout.num_engines
        self.actor = (ray.remote(RolloutActor)
                      .options(num_cpus=num_cpus, num_gpus=0, max_restarts=0, max_concurrency=concurrency,
                               scheduling_strategy=strategy)
                      .remote(config, str(run_dir), make_supervisor))
        info = self._get(self.actor.info.remote())  # also raises here if building the rollout failed
        self.pid, self.node_ip, self.num_prompts = info["pid"], info["node_ip"], info["num_prompts"]
        self._loop = asyncio.new_event_loop()  # where rank 0 runs a weight push
        logger.info("rollout: a Ray actor (pid %d on %s, bundle %d of the placement group)", self.pid,
                    self.node_ip, bundle)

    @staticmethod
    def _get(ref: Any, timeout_s: float | None = None) -> Any:
        import ray

        return ray.get(ref, timeout=timeout_s)

    def start(self) -> list[str]:
        return self._get(self.actor.start.remote())

    def take(self, batch_size: int, actor_version: int, timeout_s: float) -> list[Any] | None:
        return self._get(self.actor.take.remote(batch_size, actor_version, timeout_s))

    def suspend(self) -> None:
        self._get(self.actor.suspend.remote())

    def resume_weights(self) -> None:
        self._get(self.actor.resume_weights.remote())

    def resume(self) -> None:
        self._get(self.actor.resume.remote())

    def metrics(self) -> dict[str, float]:
        return self._get(self.actor.metrics.remote())

    def start_eval(self, step: int, actor_version: int) -> bool:
        return self._get(self.actor.start_eval.remote(step, actor_version))

    def eval_results(self, wait_s: float = 0.0) -> list[dict[str, float]]:
        return self._get(self.actor.eval_results.remote(wait_s))

    def lagging_urls(self, version: str) -> list[str]:
        return self._get(self.actor.lagging_urls.remote(version))

    def healthy_clients(self) -> list[RemoteEngine]:
        return [RemoteEngine(self.actor, url) for url in self._get(self.actor.healthy_urls.remote())]

    @contextlib.contextmanager
    def paused(self, clients: list[Any]) -> Iterator[list[Any]]:
        urls = self._get(self.actor.pause.remote([c.base_url for c in clients]))
        try:
            yield [c for c in clients if c.base_url in urls]
        finally:
            self._get(self.actor.unpause.remote(urls))

    def run(self, coro: Awaitable[T]) -> T:
        """Run `coro` (a weight push against `RemoteEngine`s) on rank 0's own loop."""
        return self._loop.run_until_complete(coro)

    def set_weights(self, model_path: str, weight_version: str) -> None:
        self._get(self.actor.set_weights.remote(model_path, weight_version))

    def state_dict(self) -> dict[str, Any]:
        return self._get(self.actor.state_dict.remote())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._get(self.actor.load_state_dict.remote(state))

    def stop(self) -> None:
        """Stop the agent loop and the engines, then the actor."""
        import ray

        try:
            self._get(self.actor.stop.remote(), timeout_s=300)
        except Exception as error:  # the actor is killed below either way
            logger.warning("stopping the rollout actor: %r", error)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)
        if not self._loop.is_closed():
            self._loop.close()
