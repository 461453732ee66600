"""`sao train` / `sao sft`: the trainer on a trajectory source, with checkpoints and exact resume.

The driver spawns the recipe's trainer ranks on this machine (gloo on CPU, NCCL on GPU), and
each rank runs `train_rank`: build the trainer and the trajectory source, restore the latest
checkpoint if any, then `training.loop.fit`: one `train_step` per batch of `data.batch_size`
trajectories until `run.total_steps`, logging every step to `<run_dir>/metrics.jsonl` (and wandb)
and checkpointing every `checkpoint.save_every` steps and at the end. The source is a recorded
file (`rollout.source=recorded`, and always for SFT: `training/recorded_source.py`) or the
rollout engines (`rollout.source=engine`: `pipeline/engine_source.py`, which also pushes each new
actor version back to the engines). The run directory and resume rules: `training/run_dir.py`.

Stopping: SIGTERM or SIGINT (Slurm preemption, `scancel`, time limit with `--signal`, Ctrl-C)
finishes the current step on every rank, writes a checkpoint (with the source's state: data
position, and for engines the buffered trajectories and unfinished prompts) and exits with code
143; the same command resumes from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from megatron_sao.config.schema import SaoConfig
from megatron_sao.training.loop import STOPPED_BY_SIGNAL
from megatron_sao.training.run_dir import prepare_resume

if TYPE_CHECKING:
    from megatron_sao.training.loop import TrajectorySource

logger = logging.getLogger(__name__)


def train_rank(config: SaoConfig, run_dir: str, mode: Literal["rl", "sft"], resume_from: str | None) -> dict[str, Any]:
    """What every trainer rank runs: the trainer on the run's source (`training.loop.fit`); returns
    the last step's metrics and how the run ended."""
    import torch.distributed as dist

    from megatron_sao.platform import init_model_parallel
    from megatron_sao.training.loop import Run, fit, resume, stop_on_signals
    from megatron_sao.training.trainer import SaoTrainer

    stop_on_signals()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per engine request otherwise
    init_model_parallel(config.parallelism, seed=config.run.seed)
    trainer = SaoTrainer(config, mode=mode)
    source = _make_source(config, Path(run_dir), mode)
    resume_step = resume(trainer, source, Path(resume_from) if resume_from is not None else None)
    if dist.get_rank() == 0:
        logger.info("%s: %s; steps %d -> %d", mode, source.describe(), trainer.state.step, config.run.total_steps)
    return dict(fit(trainer, source, Run(config, Path(run_dir), resume_step)))


def _make_source(config: SaoConfig, run_dir: Path, mode: str) -> TrajectorySource:
    if mode != "rl" or config.rollout.source == "recorded":
        from megatron_sao.training.recorded_source import RecordedSource

        return RecordedSource(config, mode)
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
    from megatron_sao.training.run_dir import run_dir_of
    from megatron_sao.utils.progress import stage_progress

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
