"""The run directory: where a run lives, which checkpoint it resumes from, and its metrics log.

`<run.output_dir>/<run.name>/` holds the resolved `config.yaml` (and the configs of earlier
segments of the same run, `config.before_step_NNNNNNN.yaml`), `metrics.jsonl`, the wandb files and,
unless `checkpoint.dir` names another place, `checkpoints/`. A run directory never mixes runs:
the resume rules (`resolve_resume`) refuse to start fresh over a run's metrics. Every training job
(`sao train`, `sao sft`, `sao value-pretrain train`) follows these rules.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from megatron_sao.config.loader import dump_config
from megatron_sao.config.schema import SaoConfig
from megatron_sao.utils.atomic import atomic_path, atomic_write_text

logger = logging.getLogger(__name__)


def run_dir_of(config: SaoConfig) -> Path:
    return Path(config.run.output_dir) / config.run.name


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


def prepare_resume(config: SaoConfig, run_dir: Path) -> tuple[Path | None, int | None]:
    """Find the checkpoint this run continues from (`resolve_resume`) and prepare the run
    directory for it. Returns (checkpoint or None, the step when that checkpoint already reaches
    `run.total_steps`: nothing to train, the directory untouched)."""
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


def prepare_run_dir(config: SaoConfig, resume_step: int | None = None) -> Path:
    """Create `run.output_dir/run.name` and write the fully resolved config into it.

    On a resume (`resume_step`: the checkpoint's step) a config that differs from the one already
    there (e.g. a raised `run.total_steps`) replaces it, and the old one is kept as
    `config.before_step_{step:07d}.yaml`: each config stays next to the metrics rows it produced.
    """
    run_dir = run_dir_of(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    previous = path.read_text() if resume_step is not None and path.is_file() else None
    with atomic_path(path) as new:
        dump_config(config, new)
        if previous is not None and new.read_text() != previous:
            atomic_write_text(run_dir / f"config.before_step_{resume_step:07d}.yaml", previous)
    return run_dir


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the rows of `path` with `step <= last_step` (a resumed run repeats the later ones);
    an unparseable row (a line cut by a kill) is dropped. Returns the number of rows kept."""
    if not path.is_file():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
            kept.append(line)
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return len(kept)


class MetricsLogger:
    """Writes every metrics dict to `<run_dir>/metrics.jsonl` and, unless disabled, to wandb.

    wandb runs offline by default (no network needed; `wandb sync <run_dir>/wandb/...` uploads
    later). A context manager so the wandb run is always finished.
    """

    def __init__(self, config: SaoConfig, run_dir: Path, resume_step: int | None = None) -> None:
        """`resume_step`: continue a run from its checkpoint at that step (rows after it, logged
        before the run stopped, are dropped so that none is duplicated); None: a new file."""
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None:
            truncate_metrics(self.path, resume_step)
            self._file = self.path.open("a")
        else:
            self._file = self.path.open("w")
        self._wandb_run = None
        if config.logging.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            # One wandb run per run directory: a resume continues it (wandb ignores steps it has).
            id_file = run_dir / "wandb_run_id.txt"
            run_id = id_file.read_text().strip() if resume_step is not None and id_file.is_file() else None
            self._wandb_run = wandb.init(
                project=config.logging.wandb_project, name=config.run.name, dir=str(run_dir),
                mode=config.logging.wandb_mode, config=_flat(config), reinit="finish_previous",
                id=run_id, resume="allow" if run_id else None,
            )
            id_file.write_text(self._wandb_run.id)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: v for k, v in metrics.items() if v is not None}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(clean, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flat(config: SaoConfig) -> dict[str, Any]:
    import dataclasses

    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            out[prefix.rstrip(".")] = value

    walk("", dataclasses.asdict(config))
    return out
