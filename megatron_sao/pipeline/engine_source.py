"""`rollout.source=engine`: training batches from live rollout engines, new weights back to them.

Rank 0 hosts the rollout (`RolloutService`: engines, agent loop, ready buffer) next to its trainer
rank; every step it takes `data.batch_size` ready trajectories and broadcasts them to the other
trainer ranks, which all train on the same list (`SaoTrainer.train_step`). After each actor update
(every `weight_sync_every` of them) all ranks stream the actor's weights in HF naming
(collective, `models/hf_export.py`) and rank 0 loads them into the paused engines
(`pipeline/weight_sync.py`), which then continue in-flight trajectories under the new version.

Only rank 0 holds rollout state: its prompt position, the unfinished prompts and the buffered
trajectories go into the checkpoint's trainer state (written by rank 0), so a resumed run
continues with the same buffer contents and data position.
"""

from __future__ import annotations

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
        # Colocated: engines and trainers time-share the devices (engines release their memory
        # while the trainer steps); disaggregated: generation stops only for weight updates.
        self.colocated = config.launcher.engine_placement == "colocated"
        self._wait_s = 0.0
        self.service: Any = None
        self.buffer: Any = None
        self.prompts: Any = None
        if self.rank0:
            self._build_rollout()

    def _build_rollout(self) -> None:
        from transformers import AutoTokenizer

        from megatron_sao.pipeline.buffer import ReadyBuffer
        from megatron_sao.pipeline.prompts import PromptStream
        from megatron_sao.pipeline.rollout_service import RolloutService, log_dir
        from megatron_sao.rollout.datasets import DatasetConfig, load_prompts
        from megatron_sao.rollout.settings import agent_loop_config_from, engine_config_from, env_factory_from

        c = self.config
        if not c.data.train_path:
            raise ValueError("rollout.source=engine needs data.train_path (the prompt dataset)")
        dataset = load_prompts(c.data.train_path, DatasetConfig(max_prompt_chars=c.data.max_prompt_chars))
        logger.info("prompts: %s (%s)", c.data.train_path, dataset.report.summary())
        self.prompts = PromptStream(dataset.samples, shuffle=c.data.shuffle, seed=c.run.seed,
                                    group_size=c.algorithm.group_size)
        p = c.pipeline
        self.buffer = ReadyBuffer(group_size=c.algorithm.group_size, max_staleness=c.algorithm.max_staleness,
                                  staleness_check=p.staleness_check, stale_policy=p.stale_policy,
                                  max_buffered=p.max_buffered or 2 * c.data.batch_size,
                                  distinct_prompts=p.distinct_prompts)
        engine_config = engine_config_from(c)
        engine_config.log_dir = log_dir(self.run_dir)
        self.service = RolloutService(
            engine_config, agent_loop_config_from(c), AutoTokenizer.from_pretrained(c.model.hf_path),
            env_factory_from(c), self.prompts, self.buffer, max_inflight_per_engine=c.rollout.max_inflight_per_engine)

    def describe(self) -> str:
        if not self.rank0:
            return "rollout engines"
        return (f"{self.config.rollout.num_engines} {self.config.rollout.engine} engine(s), "
                f"{len(self.prompts.samples)} prompts from {self.config.data.train_path}")

    # ---- the trainer loop's calls (collective: every rank calls each) ------------------------------

    def start(self, trainer: Any) -> None:
        """Start the engines, then load the trainer's actor into them (a resumed or `actor.load`
        run's weights are not the HF checkpoint the engines started from)."""
        if self.rank0:
            urls = self.service.start()
            logger.info("rollout engines: %s", ", ".join(urls))
        self._sync(trainer, initial=True)

    def next_batch(self, trainer: Any) -> list[Trajectory]:
        """`data.batch_size` ready trajectories, the same list on every rank."""
        batch: list[Any] = [None]
        if self.rank0:
            start = time.perf_counter()
            while batch[0] is None:
                self.service.raise_if_failed()
                batch[0] = self.buffer.take(self.config.data.batch_size, trainer.state.actor_version, timeout_s=1.0)
            self._wait_s = time.perf_counter() - start
            if self.colocated:
                self.service.suspend()  # the trainer takes the devices; generation waits
        dist.broadcast_object_list(batch, src=0)
        return batch[0]

    def after_step(self, trainer: Any) -> dict[str, float]:
        """Push new weights when the actor changed; the rollout's metrics (rank 0's)."""
        self._sync(trainer)
        if not self.rank0:
            return {}
        if self.colocated:
            self.service.resume()
        return {**self.service.metrics(), **self.buffer.metrics(), "time/wait_for_batch_s": self._wait_s,
                **self._take_sync_metrics(), "rollout/weight_version": float(self.synced_version),
                "data/epoch": self.prompts.epochs_done}

    def _sync(self, trainer: Any, initial: bool = False) -> None:
        """Collective: stream the actor into the engines when its version is due. At start, only
        when the engines' weights (the HF checkpoint) are not the actor's (a resume, actor.load)."""
        version = trainer.state.actor_version
        settings = self._settings()
        if initial:
            if version == 0 and not self.config.actor.load:
                self.synced_version = 0
                return
        elif version == self.synced_version or not settings.due(version):
            return
        sync = self._weight_sync(trainer, settings)
        if self.rank0:
            with self.service.paused() as clients:
                report = self.service.run(sync.push(clients, version))
            self._sync_metrics = report.metrics()
            if report.path:  # disk mode: a restarted engine loads the current weights
                self.service.launcher.set_weights(report.path, str(version))
            logger.info("engines at weight version %d (%.2f s, %.1f MB)", version, report.seconds,
                        report.num_bytes / 2**20)
        else:
            sync.follow()
        self.synced_version = version

    def _take_sync_metrics(self) -> dict[str, float]:
        metrics, self._sync_metrics = self._sync_metrics, {}
        return metrics

    def _settings(self) -> Any:
        from megatron_sao.pipeline.weight_sync import WeightSyncConfig

        ws = self.config.rollout.weight_sync
        return WeightSyncConfig(mode=ws.mode, bucket_mb=ws.bucket_mb, every_n_steps=ws.every_n_steps,
                                checksum=ws.checksum, disk_dir=str(self.run_dir / "engine_weights"),
                                engine_format="sglang" if self.config.rollout.engine == "sglang" else "safetensors",
                                engine_tp_size=self.config.rollout.sglang.tensor)

    def _weight_sync(self, trainer: Any, settings: Any) -> Any:
        if self._sync_impl is None:
            from megatron_sao.models.hf_export import HFWeightExporter
            from megatron_sao.pipeline.weight_sync import WeightSync

            exporter = HFWeightExporter(trainer.actor.chunks, self.config.model.hf_path, role="actor")
            self._sync_impl = WeightSync(exporter, settings)
        return self._sync_impl

    # ---- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if not self.rank0:
            return {}
        return {"prompts": self.prompts.state_dict(unfinished=self.service.pending_samples()),
                "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.rank0:
            self.prompts.load_state_dict(state["prompts"])
            self.buffer.load_state_dict(state["buffer"])

    def close(self) -> None:
        if self.service is not None:
            self.service.stop()
        if self._sync_impl is not None:
            self._sync_impl.exporter.close()
