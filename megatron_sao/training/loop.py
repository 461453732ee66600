"""The training loop: one `train_step` per batch of a trajectory source, with checkpoints and exact resume.

Every training job runs `fit` on every trainer rank: `sao train` / `sao sft` on a recorded file
(`training/recorded_source.py`) or on the rollout engines (`pipeline/engine_source.py`), and
`sao value-pretrain train` on its streamed corpus (`valuepretrain/stream.py`). Per step: the
source's next batch -> `SaoTrainer.train_step` -> the source's `after_step` metrics -> the job's
`on_step` hook (held-out evaluation) -> `<run_dir>/metrics.jsonl` every `logging.log_every` steps
and the console line -> checkpoint every `checkpoint.save_every` steps, at the end, and when a
signal asks to stop.

Stopping: SIGTERM or SIGINT (Slurm preemption, `scancel`, a time limit with `--signal`, Ctrl-C)
only sets a flag; at the end of the step all ranks agree on it (one all-reduce, so that every
rank stops after the same step), write a checkpoint with the source's state (data position; for
engines the buffered trajectories and unfinished prompts) and return `stopped`: the job exits
with `STOPPED_BY_SIGNAL` and the same command resumes from that checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from megatron_sao.config.schema import SaoConfig

if TYPE_CHECKING:  # the drivers import this module for STOPPED_BY_SIGNAL: no torch at import time
    from megatron_sao.rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

STOPPED_BY_SIGNAL = 143  # 128 + SIGTERM: stopped early after writing a checkpoint; rerun to resume
CONSOLE_KEYS = ("actor/loss", "actor/entropy", "actor/dis_masked_frac", "critic/value_loss",
                "critic/explained_variance", "train/reward_mean", "train/success_rate", "staleness/mean",
                "perf/tokens_per_s")
"""The metrics of the per-step console line (`step N/T key=value ...`), those present."""

_stop_requested = False


class TrainerStateLike(Protocol):
    step: int


class StepTrainer(Protocol):
    """What `fit` needs of the trainer (`training.trainer.SaoTrainer`)."""

    state: Any  # a TrainerStateLike: `step` counts the finished steps

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]: ...

    def save_checkpoint(self, checkpoints_dir: Path, extra: dict[str, Any] | None = None,
                        final: bool = False) -> Path: ...

    def load_checkpoint(self, iter_dir: Path) -> dict[str, Any]: ...


class TrajectorySource(Protocol):
    """Where a training job's batches come from. Every method is called on every trainer rank, in
    the same order (a source may run collectives in any of them)."""

    def describe(self) -> str:
        """One line for the log: what the batches are (rank 0's is shown)."""
        ...

    def start(self, trainer: Any) -> None:
        """Before the first step (after a resume restored the trainer and this source)."""
        ...

    def next_batch(self, trainer: Any) -> list[Trajectory]:
        """The trajectories of the next step: the same list on every rank, or each data-parallel
        rank's share when the trainer is told so (value pretraining gathers them itself)."""
        ...

    def after_step(self, trainer: Any) -> dict[str, float]:
        """After each train step: the source's metrics for this step (e.g. `data/epoch`)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from; saved under `data` in the checkpoint's trainer state."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict` read back from a checkpoint."""
        ...

    def close(self) -> None:
        """Release what the source started (engines, readers); called however the loop ends."""
        ...


OnStep = Callable[[Any, dict[str, float]], Mapping[str, float] | None]
"""`on_step(trainer, metrics)` after the source's metrics, before logging: extra metrics of this step."""


@dataclass(frozen=True)
class Run:
    """The run `fit` trains: its config and directory, and the checkpoint step it resumed from
    (None: a fresh start, whose metrics file starts empty)."""

    config: SaoConfig
    dir: Path
    resume_step: int | None = None


class FitResult(TypedDict):
    step: int
    stopped: bool
    metrics: dict[str, float]


def request_stop(signum: int, frame: Any) -> None:
    """The SIGTERM / SIGINT handler of a trainer rank: `fit` checkpoints and stops after this step."""
    global _stop_requested
    _stop_requested = True


def stop_on_signals() -> None:
    """Route SIGTERM and SIGINT of this rank to `request_stop` (call before the trainer is built)."""
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


def resume(trainer: StepTrainer, source: TrajectorySource, checkpoint: Path | None) -> int | None:
    """Collective. Restore the trainer and the source's position from `checkpoint`; returns the
    step reached (None for a fresh start, where nothing is loaded)."""
    if checkpoint is None:
        return None
    state = trainer.load_checkpoint(Path(checkpoint))
    try:
        source.load_state_dict(state.get("data", {}))
    except ValueError as error:  # the source cannot continue from this position: name the checkpoint
        raise ValueError(f"checkpoint {checkpoint}: {error}") from error
    return int(trainer.state.step)


def _stop_agreed() -> bool:
    """Collective: whether any rank was asked to stop. The flag is created on the compute device
    (an NCCL group has no CPU backend), so that the all-reduce needs no copy."""
    import torch

    from megatron_sao.platform.collective import any_rank_flags
    from megatron_sao.platform.device import compute_device

    flag = torch.tensor([int(_stop_requested)], dtype=torch.int32, device=compute_device())
    return bool(any_rank_flags(flag)[0])


def fit(trainer: StepTrainer, source: TrajectorySource, run: Run, on_step: OnStep | None = None, *,
        console_keys: Sequence[str] = CONSOLE_KEYS, log_checkpoints: bool = True) -> FitResult:
    """Collective (every trainer rank). Train from `trainer.state.step` to `run.total_steps`, then
    close the source (however the loop ends); returns the last step reached, whether a signal
    stopped the run and that step's metrics. `console_keys`: the metrics of the per-step console
    line; `log_checkpoints`: log `checkpoint <path>` after each save."""
    try:
        return _fit(trainer, source, run, on_step, console_keys, log_checkpoints)
    finally:
        source.close()


def _fit(trainer: StepTrainer, source: TrajectorySource, run: Run, on_step: OnStep | None,
         console_keys: Sequence[str], log_checkpoints: bool) -> FitResult:
    from megatron_sao.config.loader import config_to_dict
    from megatron_sao.platform.collective import rank
    from megatron_sao.training.checkpoint import finalize_async_saves
    from megatron_sao.training.run_dir import MetricsLogger, checkpoints_dir

    config, rank0 = run.config, rank() == 0
    total = config.run.total_steps
    ckpt_dir = checkpoints_dir(config, run.dir)
    source.start(trainer)

    def save(final: bool) -> None:
        extra = {"data": source.state_dict(), "config": config_to_dict(config)}
        path = trainer.save_checkpoint(ckpt_dir, extra, final=final)
        if rank0 and log_checkpoints:
            logger.info("checkpoint %s", path)

    metrics: dict[str, float] = {}
    saved_step, stopped = run.resume_step, False
    with contextlib.ExitStack() as stack:
        metrics_log = stack.enter_context(MetricsLogger(config, run.dir, run.resume_step)) if rank0 else None
        while trainer.state.step < total:
            metrics = trainer.train_step(source.next_batch(trainer))
            metrics.update(source.after_step(trainer))
            if on_step is not None:
                metrics.update(on_step(trainer, metrics) or {})
            step = trainer.state.step
            if metrics_log is not None:  # rank 0
                if step % config.logging.log_every == 0 or step == total:
                    metrics_log.log(metrics, step=step)
                logger.info("step %d/%d %s", step, total,
                            " ".join(f"{k}={metrics[k]:.4g}" for k in console_keys if k in metrics))
            stop = _stop_agreed()
            finalize_async_saves(blocking=False)
            every = config.checkpoint.save_every
            last = stop or step == total
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
