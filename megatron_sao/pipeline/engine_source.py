"""`rollout.source=engine`: training batches from live rollout engines, new weights back to them.

Rank 0 is the trainer rank that talks to the rollout (`pipeline/rollout_actor.py`: prompt stream,
ready buffer, `RolloutService`: engines, agent loop): a thread of rank 0 (`RolloutHost`), or with
`launcher.ray=true` a Ray actor of its own (`RemoteRollout`, same methods). Every step rank 0 takes
`data.batch_size` ready trajectories and broadcasts them to the other trainer ranks, which all
train on the same list (`SaoTrainer.train_step`). After each actor update (every
`weight_sync_every` of them) all ranks stream the actor's weights in HF naming (collective,
`models/hf_export.py`) and rank 0 loads them into the paused engines (`pipeline/weight_sync.py`),
which then continue in-flight trajectories under the new version.

Only the rollout holds rollout state: its prompt position, the unfinished prompts and the buffered
trajectories go into the checkpoint's trainer state (written by rank 0), so a resumed run
continues with the same buffer contents and data position.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_sao.config.schema import SaoConfig
from megatron_sao.rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)


class EngineSource:
    """The trainer loop's view of the rollout: `next_batch`, `after_step`, state."""

    def __init__(self, config: SaoConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.rank0 = dist.get_rank() == 0
        self.synced_version = -1
        self._sync_impl: Any = None
        self._sync_metrics: dict[str, float] = {}
        self._sync_failures = 0
        # Colocated: engines and trainers time-share the devices (engines release their memory
        # while the trainer steps); disaggregated: generation stops only for weight updates.
        # `auto` resolves as everywhere else (config.placement.engine_placement).
        from megatron_sao.config.placement import engine_placement, weight_sync_mode
        from megatron_sao.pipeline.weight_sync import check_weight_sync

        self.colocated = engine_placement(config) == "colocated"
        # `rollout.weight_sync` as the pushes will read it (auto resolved): refused now, not at the first push.
        self._sync_settings = dataclasses.replace(config.rollout.weight_sync, mode=weight_sync_mode(config))
        check_weight_sync(self._sync_settings, disk_dir=str(run_dir / "engine_weights"))
        self._wait_s = 0.0
        self._batch: list[Trajectory] = []
        self.rollout: Any = None
        """Rank 0: the `RolloutHost` in this process or the `RemoteRollout` (a Ray actor)."""
        # The in-process rollout's parts (None with a Ray actor; tools reach into them).
        self.service: Any = None
        self.buffer: Any = None
        self.prompts: Any = None
        if self.rank0:
            self._build_rollout()

    def _build_rollout(self) -> None:
        from megatron_sao.pipeline.placement import make_engine_supervisor, make_rollout_actor
        from megatron_sao.pipeline.rollout_actor import RolloutHost

        c = self.config
        if not c.data.train_path:
            raise ValueError("rollout.source=engine needs data.train_path (the prompt dataset)")
        self.rollout = make_rollout_actor(c, self.run_dir)  # placed by Ray: an actor of its own
        if self.rollout is None:
            self.rollout = RolloutHost(c, self.run_dir, make_engine_supervisor(c))
            self.service, self.buffer, self.prompts = self.rollout.service, self.rollout.buffer, self.rollout.prompts

    def describe(self) -> str:
        if not self.rank0:
            return "rollout engines"
        return (f"{self.config.rollout.num_engines} {self.config.rollout.engine} engine(s), "
                f"{self.rollout.num_prompts} prompts from {self.config.data.train_path}")

    # ---- the trainer loop's calls (collective: every rank calls each) ------------------------------

    def start(self, trainer: Any) -> None:
        """Start the engines, then load the trainer's actor into them (a resumed or `actor.load`
        run's weights are not the HF checkpoint the engines started from)."""
        if self.rank0:
            urls = self.rollout.start()
            logger.info("rollout engines: %s", ", ".join(urls))
        self._sync(trainer, initial=True)
        if self.rank0 and self.config.eval.every_n_steps:  # the starting policy, evaluated while RL starts
            self.rollout.start_eval(trainer.state.step, trainer.state.actor_version)

    def next_batch(self, trainer: Any) -> list[Trajectory]:
        """`data.batch_size` ready trajectories, the same list on every rank; their routed experts
        stay on rank 0, which sends each rank its part in the train step (training/routing_shards.py)."""
        batch: list[Any] = [None]
        mine: list[Trajectory] = []
        if self.rank0:
            start = time.perf_counter()
            while batch[0] is None:
                batch[0] = self.rollout.take(self.config.data.batch_size, trainer.state.actor_version, timeout_s=1.0)
            self._wait_s = time.perf_counter() - start
            if self.colocated:
                self.rollout.suspend()  # the trainer takes the devices; generation waits
            mine = batch[0]
            batch[0] = [dataclasses.replace(t, routed_experts=None) for t in mine]
        dist.broadcast_object_list(batch, src=0)
        self._batch = mine if self.rank0 else batch[0]
        return self._batch

    def after_step(self, trainer: Any) -> dict[str, float]:
        """Push new weights when the actor changed; the rollout's metrics (rank 0's). Colocated, in
        SGLang 0.5.23's order: the engines' weight memory comes back first, the push writes into
        it, then the rest (KV cache) comes back and generation continues."""
        if self.colocated:
            _give_back_cached_memory()  # the trainer's cached blocks: what the engines resume into
            if self.rank0:
                self.rollout.resume_weights()
        self._sync(trainer)
        if not self.rank0:
            return {}
        if self.colocated:
            self.rollout.resume()
        # Partial rollout at work: trajectories whose actions were sampled by several versions.
        spans = sum(len(set(t.action_versions())) > 1 for t in self._batch) / max(len(self._batch), 1)
        rollout = self.rollout.metrics()  # the accounting, the engines, the buffer, data/epoch
        epoch = rollout.pop("data/epoch")
        return {**rollout, "time/wait_for_batch_s": self._wait_s,
                "rollout/multi_version_frac": spans, "rollout/weight_sync_failures": float(self._sync_failures),
                **self._take_sync_metrics(), "rollout/weight_version": float(self.synced_version),
                "data/epoch": epoch, **self._evaluation(trainer)}

    def _evaluation(self, trainer: Any) -> dict[str, float]:
        """Rank 0, after the step's weight push: start the due evaluation of the new policy (it runs
        on the engines beside the training rollouts) and return the metrics of any that finished.
        The last step waits for the final policy's."""
        from megatron_sao.pipeline.evaluation import FINAL_EVAL_WAIT_S

        every = self.config.eval.every_n_steps
        if not every:
            return {}
        step, version = trainer.state.step, trainer.state.actor_version
        final = step >= self.config.run.total_steps
        results = self.rollout.eval_results(FINAL_EVAL_WAIT_S if final else 0.0)  # final: let a running one end
        if step % every == 0 or final:
            self.rollout.start_eval(step, version)
        if final:
            results += self.rollout.eval_results(FINAL_EVAL_WAIT_S)
        return results[-1] if results else {}

    def _sync(self, trainer: Any, initial: bool = False) -> None:
        """Collective: stream the actor into the engines that need it. Rank 0 decides (a due
        version goes to every healthy engine; otherwise only engines that lag behind, e.g.
        restarted after a crash) and tells the other ranks, which take part in the stream; an
        engine that fails during a push is retried once, then left for the next step."""
        version = trainer.state.actor_version
        for attempt in range(2):
            plan: list[Any] = [self._plan(version, initial, attempt) if self.rank0 else None]
            dist.broadcast_object_list(plan, src=0)
            if plan[0] is None:
                return
            sync = self._weight_sync(trainer)
            if self.rank0:
                self._push(sync, plan[0], version)
            else:
                sync.follow()
            if attempt == 0 and plan[0] == "due":
                self.synced_version = version

    def _plan(self, version: int, initial: bool, attempt: int) -> str | list[str] | None:
        """Rank 0: "due" (every healthy engine), the URLs of lagging engines, or None."""
        from megatron_sao.pipeline.weight_sync import is_due

        if attempt == 0:
            if initial and (version > 0 or self.config.actor.load):
                return "due"
            if not initial and version != self.synced_version and is_due(self._sync_settings, version):
                return "due"
            if initial:
                self.synced_version = version
                return None
        current = str(self.synced_version)
        lagging = self.rollout.lagging_urls(current) if self.synced_version >= 0 else []
        return lagging or None

    def _push(self, sync: Any, plan: str | list[str], version: int) -> None:
        """Rank 0: push `version` (or, for lagging engines, the current synced version's weights,
        which are the actor's: the actor has not changed since) into the planned engines. With a
        rollout actor the push runs here against stand-ins that forward each engine call to it."""
        from megatron_sao.pipeline.weight_sync import WeightSyncError
        from megatron_sao.rollout.engine_protocol import EngineError

        healthy = self.rollout.healthy_clients()
        clients = healthy if plan == "due" else [c for c in healthy if c.base_url in plan]
        label = version if plan == "due" else self.synced_version
        try:
            with self.rollout.paused(clients) as paused:
                if not paused:
                    sync.follow()  # nobody to send to: still take part in the collective stream
                    return
                report = self.rollout.run(sync.push(paused, label))
        except (WeightSyncError, EngineError) as e:
            self._sync_failures += 1
            logger.warning("weight sync to version %s failed (%s); engines that missed it are updated later", label, e)
            return
        self._sync_metrics = report.metrics()
        if report.path:  # disk mode: a restarted engine loads the current weights
            self.rollout.set_weights(report.path, str(label))
        logger.info("engines %s at weight version %s (%.2f s, %.1f MB)", ",".join(report.engines), label,
                    report.seconds, report.num_bytes / 2**20)

    def _take_sync_metrics(self) -> dict[str, float]:
        metrics, self._sync_metrics = self._sync_metrics, {}
        return metrics

    def _weight_sync(self, trainer: Any) -> Any:
        """The run's `WeightSync`: `rollout.weight_sync` with its mode resolved, and what the run
        knows of its engines (payload format, TP size) and where disk mode writes."""
        if self._sync_impl is None:
            from megatron_sao.models.hf_export import HFWeightExporter
            from megatron_sao.pipeline.weight_sync import WeightSync

            c = self.config
            exporter = HFWeightExporter(trainer.actor.chunks, c.model.hf_path, role="actor")
            self._sync_impl = WeightSync(exporter, self._sync_settings, disk_dir=str(self.run_dir / "engine_weights"),
                                         engine_format="sglang" if c.rollout.engine == "sglang" else "safetensors",
                                         engine_tp_size=c.rollout.sglang.tensor)
        return self._sync_impl

    # ---- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if not self.rank0:
            return {}
        return self.rollout.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.rank0:
            self.rollout.load_state_dict(state)

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.stop()
        if self._sync_impl is not None:
            self._sync_impl.exporter.close()


def _give_back_cached_memory() -> None:
    """Colocated engines resume into the memory the trainer's step used: return the blocks torch's
    caching allocator keeps (activations, gradients of the step) to the device first."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()

