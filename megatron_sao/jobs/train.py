"""`sao train` / `sao sft`: the trainer on a trajectory source, with checkpoints and exact resume.

The driver spawns the recipe's trainer ranks on this machine (gloo on CPU, NCCL on GPU), and
each rank runs `train_rank`: build the trainer and the trajectory source, restore the latest
checkpoint if any, then one `train_step` per batch of `data.batch_size` trajectories until
`run.total_steps`, logging every step to `<run_dir>/metrics.jsonl` (and wandb) and
checkpointing every `checkpoint.save_every` steps and at the end. The source is a recorded file
(`rollout.source=recorded`, and always for SFT) or the rollout engines (`rollout.source=engine`:
`pipeline/engine_source.py`, which also pushes each new actor version back to the engines).

Stopping: SIGTERM or SIGINT (Slurm preemption, `scancel`, time limit with `--signal`, Ctrl-C)
finishes the current step on every rank, writes a checkpoint (with the source's state: data
position, and for engines the buffered trajectories and unfinished prompts) and exits with code
143; the same command resumes from it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from megatron_sao.config.schema import SaoConfig

logger = logging.getLogger(__name__)

STOPPED_BY_SIGNAL = 143  # 128 + SIGTERM: stopped early after writing a checkpoint; rerun to resume
_stop_requested = False
_CONSOLE_KEYS = ("actor/loss", "actor/entropy", "actor/dis_masked_frac", "critic/value_loss",
                 "critic/explained_variance", "train/reward_mean", "train/success_rate", "staleness/mean",
                 "perf/tokens_per_s")


def checkpoints_dir(config: SaoConfig, run_dir: Path) -> Path:
    return Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints"


def resolve_resume(config: SaoConfig, run_dir: Path) -> Path | None:
    """The checkpoint (an `iter_NNNNNNN` directory) this run continues from, or None for a fresh
    start. A run directory never mixes runs: starting fresh where a run already left metrics is
    refused, naming how to resume or rename."""
    from megatron_sao.training.checkpoint import find_latest_checkpoint

    resume = config.checkpoint.resume
    mode = {True: "true", False: "none", "false": "none", "true": "true"}.get(resume, resume)
    ckpt_dir = checkpoints_dir(config, run_dir)
    latest = find_latest_checkpoint(ckpt_dir) if ckpt_dir.is_dir() else None
    used = (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0
    if mode not in ("auto", "true", "none"):  # an explicit checkpoint path
        path = Path(str(mode))
        found = path if path.name.startswith("iter_") and path.is_dir() else find_latest_checkpoint(path)
        if found is None:
            raise ValueError(f"checkpoint.resume={path}: not an iter_NNNNNNN directory nor a checkpoints "
                             "directory with a complete checkpoint")
        if used:
            raise ValueError(f"run directory {run_dir} already holds a run's metrics; resume it with "
                             "checkpoint.resume=auto, or pick a new run.name to start from another checkpoint")
        return found
    if mode == "none":
        if used or latest is not None:
            raise ValueError(f"run directory {run_dir} already holds a run; continue it with checkpoint.resume=auto, "
                             "or choose another run.name (or delete the directory) to start fresh")
        return None
    if latest is None:
        if mode == "true":
            raise ValueError(f"checkpoint.resume=true but {ckpt_dir} has no complete checkpoint")
        if used:
            raise ValueError(f"run directory {run_dir} holds metrics of a run that left no complete checkpoint; "
                             "choose another run.name (or delete the directory) to start fresh")
    return latest


def check_trajectory_source(config: SaoConfig, mode: str) -> None:
    """The files the run's trajectory source reads exist (a clear error before anything starts)."""
    if mode == "rl" and config.rollout.source == "engine":
        if not Path(config.data.train_path).is_file():
            raise ValueError(f"data.train_path={config.data.train_path!r}: no such prompt file (rollout.source=engine "
                             "rolls out the prompts of data.train_path)")
        if config.eval.every_n_steps and not Path(config.eval.prompts_path).is_file():
            raise ValueError(f"eval.prompts_path={config.eval.prompts_path!r}: no such prompt file (eval.every_n_steps="
                             f"{config.eval.every_n_steps} rolls out held-out prompts from it)")
    elif not config.data.trajectories_path:
        raise ValueError("data.trajectories_path is empty: set it to a Parquet or JSONL file of trajectories")
    elif not Path(config.data.trajectories_path).is_file():
        raise ValueError(f"data.trajectories_path={config.data.trajectories_path!r}: no such file")
    else:
        from megatron_sao.rollout.recorded import check_trajectory_file

        check_trajectory_file(config.data.trajectories_path)  # empty, no rows, wrong schema: here, not on ranks


def prepare_resume(config: SaoConfig, run_dir: Path) -> tuple[Path | None, int | None]:
    """Find the checkpoint this run continues from (`resolve_resume`) and prepare the run
    directory for it. Returns (checkpoint or None, the step when that checkpoint already reaches
    `run.total_steps`: nothing to train, the directory untouched)."""
    from megatron_sao.utils.run_logging import prepare_run_dir

    resume_from = resolve_resume(config, run_dir)
    if resume_from is None:
        prepare_run_dir(config)
        return None, None
    step = int(resume_from.name.removeprefix("iter_"))
    if step >= config.run.total_steps:
        print(f"run {run_dir} is complete: checkpoint {resume_from} is at step {step} >= run.total_steps="
              f"{config.run.total_steps}; raise run.total_steps to train on", flush=True)
        return resume_from, step
    print(f"resuming from {resume_from}", flush=True)
    prepare_run_dir(config, resume_step=step)
    return resume_from, None


def _request_stop(signum: int, frame: Any) -> None:
    global _stop_requested
    _stop_requested = True


def train_rank(config: SaoConfig, run_dir: str, mode: Literal["rl", "sft"], resume_from: str | None) -> dict[str, Any]:
    """What every trainer rank runs; returns the last step's metrics and how the run ended."""
    import torch.distributed as dist

    from megatron_sao.platform import init_model_parallel
    from megatron_sao.training.trainer import SaoTrainer

    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per engine request otherwise
    init_model_parallel(config.parallelism, seed=config.run.seed)
    trainer = SaoTrainer(config, mode=mode)
    source = _make_source(config, Path(run_dir), mode)
    ckpt_dir = checkpoints_dir(config, Path(run_dir))
    resume_step = None
    if resume_from is not None:
        state = trainer.load_checkpoint(Path(resume_from))
        source.load_state_dict(state["data"])
        resume_step = trainer.state.step
    rank0 = dist.get_rank() == 0
    if rank0:
        logger.info("%s: %s; steps %d -> %d", mode, source.describe(), trainer.state.step, config.run.total_steps)
    try:
        return _loop(config, trainer, source, run_dir, ckpt_dir, resume_step, rank0)
    finally:
        source.close()


def _loop(config: SaoConfig, trainer: Any, source: Any, run_dir: str, ckpt_dir: Path, resume_step: int | None,
          rank0: bool) -> dict[str, Any]:
    from megatron_sao.config.loader import config_to_dict
    from megatron_sao.platform.collective import any_rank
    from megatron_sao.training.checkpoint import finalize_async_saves
    from megatron_sao.utils.run_logging import MetricsLogger

    source.start(trainer)

    def save(final: bool = False) -> None:
        extra = {"data": source.state_dict(), "config": config_to_dict(config)}
        path = trainer.save_checkpoint(ckpt_dir, extra, final=final)
        if rank0:
            logger.info("checkpoint %s", path)

    metrics: dict[str, float] = {}
    saved_step, stopped = resume_step, False
    with MetricsLogger(config, Path(run_dir), resume_step) if rank0 else contextlib.nullcontext() as metrics_log:
        while trainer.state.step < config.run.total_steps:
            metrics = trainer.train_step(source.next_batch(trainer))
            metrics.update(source.after_step(trainer))
            step = trainer.state.step
            if rank0:
                if step % config.logging.log_every == 0 or step == config.run.total_steps:
                    metrics_log.log(metrics, step=step)
                logger.info("step %d/%d %s", step, config.run.total_steps,
                            " ".join(f"{k}={metrics[k]:.4g}" for k in _CONSOLE_KEYS if k in metrics))
            stop = any_rank(_stop_requested)
            finalize_async_saves(blocking=False)
            every = config.checkpoint.save_every
            last = stop or step == config.run.total_steps
            if last or (every and step % every == 0):
                save(final=last)
                saved_step = step
            if stop:
                stopped = True
                break
        if saved_step != trainer.state.step:
            save(final=True)
        finalize_async_saves(blocking=True)
    return {"step": trainer.state.step, "stopped": stopped, "metrics": metrics}


class _RecordedSource:
    """A recorded trajectory file as the trainer loop's source (every rank reads the file; only
    rank 0 reads its routing, and sends each rank its part: training/routing_shards.py)."""

    def __init__(self, config: SaoConfig, mode: str = "rl") -> None:
        import torch.distributed as dist

        from megatron_sao.models.build import model_vocab_size
        from megatron_sao.rollout.recorded import RecordedTrajectories
        from megatron_sao.rollout.settings import model_routing_spec, routing_replay_enabled

        replay = mode == "rl" and routing_replay_enabled(config)
        self.data = RecordedTrajectories(config.data.trajectories_path, config.data.batch_size,
                                         routing=model_routing_spec(config) if replay else None,
                                         with_routing=replay and dist.get_rank() == 0,
                                         vocab_size=model_vocab_size(config))

    def describe(self) -> str:
        return f"{len(self.data)} trajectories from {self.data.path} ({self.data.report.summary()})"

    def start(self, trainer: Any) -> None:
        pass

    def next_batch(self, trainer: Any) -> list[Any]:
        return self.data.next_batch()

    def after_step(self, trainer: Any) -> dict[str, float]:
        return {"data/epoch": self.data.epoch}

    def state_dict(self) -> dict[str, Any]:
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state)

    def close(self) -> None:
        pass


def _make_source(config: SaoConfig, run_dir: Path, mode: str) -> Any:
    if mode != "rl" or config.rollout.source == "recorded":
        return _RecordedSource(config, mode)
    from megatron_sao.pipeline.engine_source import EngineSource

    return EngineSource(config, run_dir)


def drive(config: SaoConfig, run_dir: Path,
          launch: Callable[[str | None], dict[str, Any]]) -> tuple[int, dict[str, Any], Path]:
    """What every launch path does around its ranks: check the layout against the model (which also
    builds a tiny checkpoint once, before ranks race for it), resolve the checkpoint to resume from
    (a run already complete returns at once), then `launch(resume_from)` -> rank 0's result.
    Returns (exit code, result, run directory)."""
    from megatron_sao.models.build import check_layout_fits_model
    from megatron_sao.utils.console import show_output

    check_layout_fits_model(config)
    show_output()  # the checks are done: what follows (and the ranks' progress) is shown live
    resume_from, complete = prepare_resume(config, run_dir)
    if complete is not None:
        return 0, {"step": complete, "stopped": False, "metrics": {}}, run_dir
    result = launch(str(resume_from) if resume_from else None)
    return (STOPPED_BY_SIGNAL if result["stopped"] else 0), result, run_dir


def run_train(config: SaoConfig, mode: Literal["rl", "sft"] = "rl") -> tuple[int, dict[str, Any], Path]:
    """Run the job on its trainer ranks: `launcher.nproc_per_node` local processes, srun tasks
    inside a Slurm job (launcher.kind=slurm), or Ray actors (launcher.ray; `platform/launch.py`).
    Returns (exit code, rank 0's result, run directory)."""
    from megatron_sao.config.validate import trainer_world_size
    from megatron_sao.jobs.preflight import check_train_job
    from megatron_sao.platform.launch import launch_ranks, rank_launcher
    from megatron_sao.utils.progress import stage_progress
    from megatron_sao.utils.run_logging import run_dir_of

    check_train_job(config, mode)
    where = rank_launcher(config.launcher, "submit with `sao launch slurm RECIPE --nodes N`")
    run_dir = run_dir_of(config)
    ray = None
    if where != "local":  # srun tasks and Ray workers may run elsewhere: absolute paths only
        run_dir = run_dir.resolve()
    if where == "ray":  # the trainer ranks (and, from rank 0, the engines) in one placement group
        from megatron_sao.pipeline.placement import ray_ranks_plan

        ray = ray_ranks_plan(config, with_engines=mode == "rl" and config.rollout.source == "engine")

    def launch(resume_from: str | None) -> dict[str, Any]:
        return launch_ranks(train_rank, trainer_world_size(config), config, str(run_dir), mode, resume_from,
                            launcher=config.launcher, run_dir=run_dir, ray=ray,
                            announce=f"run directory: {run_dir} (resolved config: {run_dir / 'config.yaml'})")

    with stage_progress(config, run_dir):
        return drive(config, run_dir, launch)
