"""What every rank of `sao value-pretrain train` runs: the critic alone, trained on the streamed corpus.

Per step, each data-parallel rank reads `data.batch_size / dp` trajectories from its own row
groups (`stream.RankStream`); the token ids are exchanged within the data-parallel group so that
`SaoTrainer.train_step` (critic mode) can balance micro-batches by token count across ranks as it
does in RL (reading stays per rank; only the batch's ids travel, a few MB per step at scale).
Targets, K, frozen groups and the NaN guard are the trainer's: Monte-Carlo returns at
`algorithm.lambda_critic=1`, TD(lambda) against the critic itself below 1.

The loop is `training.loop.fit`; this module holds what is value pretraining's own: the streamed
source (`StreamedSource`) and the held-out evaluation hook (`HeldoutEvaluation`).

The checkpoint (training/checkpoint/ layout) carries every data-parallel rank's stream position
in `trainer_state.json` under `data`, so a resume continues mid-epoch exactly; it needs the same
data-parallel size (TP / PP / EP may change). Held-out evaluation every `value_pretrain.eval_every`
steps and after the last one writes `calibration.json` (and one per step under `calibration/`);
`calibration.png` is rendered at the end, `data_report.json` lists bad shards and skipped rows.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from megatron_sao.config.schema import SaoConfig
from megatron_sao.rollout.trajectory import Trajectory
from megatron_sao.utils.atomic import atomic_write_json

logger = logging.getLogger(__name__)

_CONSOLE = ("critic/value_loss", "critic/explained_variance", "eval/explained_variance", "perf/tokens_per_s")


def _dp_all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, data)


class StreamedSource:
    """`training.loop.TrajectorySource` over the corpus: each data-parallel rank reads its share
    (`per_rank` trajectories of its own row groups), and the shares are exchanged so that every
    rank holds the step's whole batch. The state is every data-parallel rank's stream position."""

    def __init__(self, stream: Any, per_rank: int, dp_rank: int, dp_size: int, corpus_dir: Path) -> None:
        self.stream, self.per_rank, self.dp_rank, self.dp_size = stream, per_rank, dp_rank, dp_size
        self.corpus_dir = corpus_dir
        self.batch_started = 0.0
        """`time.perf_counter()` when the last batch was asked for (the step's wall time with data)."""
        self._stream_s = 0.0

    def describe(self) -> str:
        return f"corpus {self.corpus_dir}, {self.per_rank} trajectories per data-parallel rank"

    def start(self, trainer: Any) -> None:
        pass

    def next_batch(self, trainer: Any) -> list[Trajectory]:
        self.batch_started = time.perf_counter()
        batch = [t for part in _dp_all_gather(self.stream.next_batch(self.per_rank)) for t in part]
        self._stream_s = time.perf_counter() - self.batch_started
        return batch

    def after_step(self, trainer: Any) -> dict[str, float]:
        return {"data/epoch": self.stream.epoch_progress, "time/stream_s": self._stream_s}

    def state_dict(self) -> dict[str, Any]:
        return {"dp_size": self.dp_size, "ranks": _dp_all_gather(self.stream.state_dict()),
                "corpus": str(self.corpus_dir)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("dp_size") != self.dp_size:
            raise ValueError(f"it streamed the corpus over {state.get('dp_size')} data-parallel ranks, this run has "
                             f"{self.dp_size}: resume with the same data-parallel size (TP / PP / EP may change), or "
                             "start a new run with critic.load= to keep only the weights")
        self.stream.load_state_dict(state["ranks"][self.dp_rank])

    def close(self) -> None:
        pass


class HeldoutEvaluation:
    """The `on_step` hook of value pretraining: the step's throughput with data, and the held-out
    evaluation every `value_pretrain.eval_every` steps and after the last one (`calibration.json`,
    one per step under `calibration/`). `last` keeps the latest result."""

    def __init__(self, config: SaoConfig, run_dir: Path, source: StreamedSource, heldout: list[Trajectory],
                 rank0: bool) -> None:
        from megatron_sao.valuepretrain.evaluate import return_range

        self.config, self.run_dir, self.source, self.heldout, self.rank0 = config, run_dir, source, heldout, rank0
        self.value_range = return_range(heldout, config.algorithm.gamma) if heldout else None
        self.last: Any = None

    def __call__(self, trainer: Any, metrics: dict[str, float]) -> dict[str, float]:
        with_data_s = time.perf_counter() - self.source.batch_started
        out = {"perf/tokens_per_s_with_data": metrics["train/tokens"] / with_data_s}
        step, every = trainer.state.step, self.config.value_pretrain.eval_every
        if step == self.config.run.total_steps or (every and step % every == 0):
            self.last = self.evaluate(trainer) or self.last
            if self.last is not None and self.last.step == step:
                out.update(self.last.metrics())
        return out

    def evaluate(self, trainer: Any) -> Any:
        from megatron_sao.training.trainer import role_packing
        from megatron_sao.valuepretrain.evaluate import evaluate_heldout

        if not self.heldout or self.value_range is None:
            return None
        vp = self.config.value_pretrain
        packing = role_packing(self.config, "critic")  # the trainer's rule: evaluation pads as training does
        result = evaluate_heldout(trainer.critic, self.heldout, packing, self.source.dp_rank, self.source.dp_size,
                                  self.config.algorithm.gamma, self.value_range, vp.calibration_bins,
                                  trainer.state.step)
        if self.rank0:
            _write_json(self.run_dir / "calibration" / f"step_{result.step:07d}.json", result.to_dict())
            _write_json(self.run_dir / "calibration.json", result.to_dict())
            logger.info("held-out step %d: explained variance %s, value MSE %.4g, calibration error %.4g\n%s",
                        result.step, result.ev_text(), result.value_mse, result.calibration_error, result.table())
        return result


def pretrain_rank(config: SaoConfig, run_dir: str, resume_from: str | None) -> dict[str, Any]:
    """Train to `run.total_steps` (`training.loop.fit` on the streamed corpus); returns the step
    reached, whether a signal stopped it, the last metrics and the last held-out result."""
    import torch.distributed as dist

    from megatron_sao.platform import init_model_parallel
    from megatron_sao.rollout.datasets import LoadReport
    from megatron_sao.training.loop import Run, fit, resume, stop_on_signals
    from megatron_sao.training.trainer import SaoTrainer
    from megatron_sao.valuepretrain.check import check_shards, handle_bad_shards
    from megatron_sao.valuepretrain.corpus import read_manifest
    from megatron_sao.valuepretrain.settings import corpus_dir_of
    from megatron_sao.valuepretrain.stream import RankStream, read_split

    stop_on_signals()
    vp, run_path = config.value_pretrain, Path(run_dir)
    init_model_parallel(config.parallelism, seed=config.run.seed)
    corpus_dir = corpus_dir_of(config)
    manifest = read_manifest(corpus_dir)
    problems = check_shards(corpus_dir, manifest.shards, vp.verify_hashes)
    handle_bad_shards(problems, vp.on_bad_shard)  # same list on every rank: all stop or none
    bad = {p.name for p in problems}
    trainer = SaoTrainer(config, mode="critic")
    dp_rank, dp_size = trainer.dp_rank, trainer.dp_size
    stream = RankStream(corpus_dir, [s for s in manifest.split("train") if s.name not in bad], config.run.seed,
                        dp_rank, dp_size, vp.on_bad_shard)
    heldout_report = LoadReport()
    heldout = read_split(corpus_dir, [s for s in manifest.split("heldout") if s.name not in bad],
                         vp.eval_max_trajectories, heldout_report, vp.on_bad_shard)
    per_rank = config.data.batch_size // dp_size
    source = StreamedSource(stream, per_rank, dp_rank, dp_size, corpus_dir)
    resume_step = resume(trainer, source, Path(resume_from) if resume_from is not None else None)
    rank0 = dist.get_rank() == 0
    if rank0:
        totals = manifest.totals()
        logger.info("value pretraining on %s: %d train / %d held-out trajectories (%d evaluated), %d bad shard(s); "
                    "steps %d -> %d, %d trajectories per step (%d per data-parallel rank)", corpus_dir,
                    totals["train"]["trajectories"], totals["heldout"]["trajectories"], len(heldout), len(bad),
                    trainer.state.step, config.run.total_steps, config.data.batch_size, per_rank)
        if not heldout:
            logger.warning("no held-out trajectories: no explained variance / calibration (set "
                           "value_pretrain.heldout_fraction > 0 when generating)")
    evaluation = HeldoutEvaluation(config, run_path, source, heldout, rank0)
    result = fit(trainer, source, Run(config, run_path, resume_step), evaluation, console_keys=_CONSOLE,
                 log_checkpoints=False)
    last_eval = evaluation.last
    reports = _dp_all_gather({"rank": dp_rank, "rows": _report_dict(stream.report),
                              "bad_row_groups": [vars_of(p) for p in stream.bad_units]})
    if rank0:
        _write_json(run_path / "data_report.json", {"bad_shards": [vars_of(p) for p in problems],
                                                     "train_ranks": reports,
                                                     "heldout": _report_dict(heldout_report)})
        if last_eval is not None:
            from megatron_sao.valuepretrain.plot import plot_calibration

            plot_calibration(run_path / "calibration.json", run_path / "metrics.jsonl", run_path / "calibration.png")
    return {"step": result["step"], "stopped": result["stopped"], "metrics": result["metrics"],
            "heldout": last_eval.to_dict() if last_eval is not None else None,
            "skipped_rows": stream.report.num_skipped, "bad_shards": sorted(bad)}


def vars_of(problem: Any) -> dict[str, Any]:
    return {"shard": problem.name, "reason": problem.reason, "detail": problem.detail, "row_group": problem.row_group}


def _report_dict(report: Any) -> dict[str, Any]:
    return {"rows": report.num_rows, "loaded": report.num_loaded, "skipped": dict(report.counts),
            "skipped_rows": [{"shard": s.path, "row": s.row, "reason": s.reason, "detail": s.detail}
                             for s in report.skipped]}
