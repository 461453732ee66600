"""What every rank of `sao value-pretrain train` runs: the critic alone, trained on the streamed corpus.

Per step, each data-parallel rank reads `data.batch_size / dp` trajectories from its own row
groups (`stream.RankStream`); the token ids are exchanged within the data-parallel group so that
`SaoTrainer.train_step` (critic mode) can balance micro-batches by token count across ranks as it
does in RL (reading stays per rank; only the batch's ids travel, a few MB per step at scale).
Targets, K, frozen groups and the NaN guard are the trainer's: Monte-Carlo returns at
`algorithm.lambda_critic=1`, TD(lambda) against the critic itself below 1.

The checkpoint (training/checkpoint.py layout) carries every data-parallel rank's stream position
in `trainer_state.json` under `data`, so a resume continues mid-epoch exactly; it needs the same
data-parallel size (TP / PP / EP may change). Held-out evaluation every `value_pretrain.eval_every`
steps and after the last one writes `calibration.json` (and one per step under `calibration/`);
`calibration.png` is rendered at the end, `data_report.json` lists bad shards and skipped rows.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from pathlib import Path
from typing import Any

from megatron_sao.config.schema import SaoConfig
from megatron_sao.utils.atomic import atomic_write_json

logger = logging.getLogger(__name__)

_stop_requested = False
_CONSOLE = ("critic/value_loss", "critic/explained_variance", "eval/explained_variance", "perf/tokens_per_s")


def _request_stop(signum: int, frame: Any) -> None:
    global _stop_requested
    _stop_requested = True


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


def pretrain_rank(config: SaoConfig, run_dir: str, resume_from: str | None) -> dict[str, Any]:
    """Train to `run.total_steps`; returns the step reached, whether a signal stopped it, the last
    metrics and the last held-out result."""
    import torch
    import torch.distributed as dist

    from megatron_sao.config.loader import config_to_dict
    from megatron_sao.jobs.train import checkpoints_dir
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.rollout.datasets import LoadReport
    from megatron_sao.training.checkpoint import finalize_async_saves
    from megatron_sao.training.trainer import SaoTrainer
    from megatron_sao.utils.run_logging import MetricsLogger
    from megatron_sao.valuepretrain.check import check_shards, handle_bad_shards
    from megatron_sao.valuepretrain.corpus import read_manifest
    from megatron_sao.valuepretrain.evaluate import evaluate_heldout, return_range
    from megatron_sao.valuepretrain.settings import corpus_dir_of
    from megatron_sao.valuepretrain.stream import RankStream, read_split

    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
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
    value_range = return_range(heldout, config.algorithm.gamma) if heldout else None
    resume_step = None
    if resume_from is not None:
        state = trainer.load_checkpoint(Path(resume_from))
        saved = state.get("data", {})
        if saved.get("dp_size") != dp_size:
            raise ValueError(f"checkpoint {resume_from} streamed the corpus over {saved.get('dp_size')} data-parallel "
                             f"ranks, this run has {dp_size}: resume with the same data-parallel size (TP / PP / EP "
                             "may change), or start a new run with critic.load= to keep only the weights")
        stream.load_state_dict(saved["ranks"][dp_rank])
        resume_step = trainer.state.step
    rank0 = dist.get_rank() == 0
    per_rank = config.data.batch_size // dp_size
    if rank0:
        totals = manifest.totals()
        logger.info("value pretraining on %s: %d train / %d held-out trajectories (%d evaluated), %d bad shard(s); "
                    "steps %d -> %d, %d trajectories per step (%d per data-parallel rank)", corpus_dir,
                    totals["train"]["trajectories"], totals["heldout"]["trajectories"], len(heldout), len(bad),
                    trainer.state.step, config.run.total_steps, config.data.batch_size, per_rank)
        if not heldout:
            logger.warning("no held-out trajectories: no explained variance / calibration (set "
                           "value_pretrain.heldout_fraction > 0 when generating)")

    def evaluate() -> Any:
        if not heldout:
            return None
        result = evaluate_heldout(trainer.critic, heldout, critic_packing(config), dp_rank, dp_size,
                                  config.algorithm.gamma, value_range, vp.calibration_bins, trainer.state.step)
        if rank0:
            _write_json(run_path / "calibration" / f"step_{result.step:07d}.json", result.to_dict())
            _write_json(run_path / "calibration.json", result.to_dict())
            logger.info("held-out step %d: explained variance %s, value MSE %.4g, calibration error %.4g\n%s",
                        result.step, result.ev_text(), result.value_mse, result.calibration_error, result.table())
        return result

    def save(final: bool = False) -> None:
        extra = {"data": {"dp_size": dp_size, "ranks": _dp_all_gather(stream.state_dict()), "corpus": str(corpus_dir)},
                 "config": config_to_dict(config)}
        trainer.save_checkpoint(checkpoints_dir(config, run_path), extra, final=final)

    metrics: dict[str, float] = {}
    last_eval = None
    saved_step, stopped = resume_step, False
    with MetricsLogger(config, run_path, resume_step) if rank0 else contextlib.nullcontext() as metrics_log:
        while trainer.state.step < config.run.total_steps:
            start = time.perf_counter()
            batch = [t for part in _dp_all_gather(stream.next_batch(per_rank)) for t in part]
            data_s = time.perf_counter() - start
            metrics = trainer.train_step(batch)
            step = trainer.state.step
            metrics.update({"data/epoch": stream.epoch_progress, "time/stream_s": data_s,
                            "perf/tokens_per_s_with_data": metrics["train/tokens"] / (time.perf_counter() - start)})
            last = step == config.run.total_steps
            if last or (vp.eval_every and step % vp.eval_every == 0):
                last_eval = evaluate() or last_eval
                if last_eval is not None and last_eval.step == step:
                    metrics.update(last_eval.metrics())
            if rank0:
                if step % config.logging.log_every == 0 or last:
                    metrics_log.log(metrics, step=step)
                logger.info("step %d/%d %s", step, config.run.total_steps,
                            " ".join(f"{k}={metrics[k]:.4g}" for k in _CONSOLE if k in metrics))
            stop = torch.tensor([float(_stop_requested)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            finalize_async_saves(blocking=False)
            every = config.checkpoint.save_every
            if stop.item() or last or (every and step % every == 0):
                save(final=bool(stop.item()) or last)
                saved_step = step
            if stop.item():
                stopped = True
                break
        if saved_step != trainer.state.step:
            save(final=True)
        finalize_async_saves(blocking=True)
    reports = _dp_all_gather({"rank": dp_rank, "rows": _report_dict(stream.report),
                              "bad_row_groups": [vars_of(p) for p in stream.bad_units]})
    if rank0:
        _write_json(run_path / "data_report.json", {"bad_shards": [vars_of(p) for p in problems],
                                                     "train_ranks": reports,
                                                     "heldout": _report_dict(heldout_report)})
        if last_eval is not None:
            from megatron_sao.valuepretrain.plot import plot_calibration

            plot_calibration(run_path / "calibration.json", run_path / "metrics.jsonl", run_path / "calibration.png")
    return {"step": trainer.state.step, "stopped": stopped, "metrics": metrics,
            "heldout": last_eval.to_dict() if last_eval is not None else None,
            "skipped_rows": stream.report.num_skipped, "bad_shards": sorted(bad)}


def critic_packing(config: SaoConfig) -> Any:
    """The critic's micro-batch packing, as the trainer derives it (padding to TP under sequence parallel)."""
    from megatron_sao.config.validate import sequence_parallel_enabled
    from megatron_sao.training.batches import PackingConfig

    critic = config.critic
    return PackingConfig(micro_batch_size=critic.micro_batch_size,
                         max_tokens_per_micro_batch=critic.max_tokens_per_micro_batch,
                         pad_to_multiple_of=config.parallelism.tensor if sequence_parallel_enabled(config) else 1)


def vars_of(problem: Any) -> dict[str, Any]:
    return {"shard": problem.name, "reason": problem.reason, "detail": problem.detail, "row_group": problem.row_group}


def _report_dict(report: Any) -> dict[str, Any]:
    return {"rows": report.num_rows, "loaded": report.num_loaded, "skipped": dict(report.counts),
            "skipped_rows": [{"shard": s.path, "row": s.row, "reason": s.reason, "detail": s.detail}
                             for s in report.skipped]}
