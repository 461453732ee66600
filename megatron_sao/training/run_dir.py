"""Run directories and metric logging (JSONL always; wandb, offline by default)."""

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
