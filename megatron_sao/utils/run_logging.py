"""Run directories and metric logging (JSONL always; wandb, offline by default)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from megatron_sao.config.loader import dump_config
from megatron_sao.config.schema import SaoConfig

logger = logging.getLogger(__name__)


def prepare_run_dir(config: SaoConfig) -> Path:
    """Create `run.output_dir/run.name` and write the fully resolved config into it."""
    run_dir = Path(config.run.output_dir) / config.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.yaml")
    return run_dir


class MetricsLogger:
    """Writes every metrics dict to `<run_dir>/metrics.jsonl` and, unless disabled, to wandb.

    wandb runs offline by default (no network needed; `wandb sync <run_dir>/wandb/...` uploads
    later). A context manager so the wandb run is always finished.
    """

    def __init__(self, config: SaoConfig, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._wandb_run = None
        if config.logging.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self._wandb_run = wandb.init(
                project=config.logging.wandb_project, name=config.run.name, dir=str(run_dir),
                mode=config.logging.wandb_mode, config=_flat(config), reinit="finish_previous",
            )

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
