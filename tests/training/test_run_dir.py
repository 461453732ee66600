"""The run-directory rules (`training/run_dir.py`): a run directory never mixes runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sao.config import load_config
from megatron_sao.training.run_dir import resolve_resume


def _config(tmp_path: Path, name: str, *overrides: str):
    return load_config(None, [f"run.output_dir={tmp_path}", f"run.name={name}", "logging.wandb_mode=disabled",
                              *overrides])


def test_run_directory_is_never_mixed(tmp_path):
    cfg = _config(tmp_path, "used")
    assert resolve_resume(cfg, tmp_path / "used") is None  # fresh
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="left no complete checkpoint"):
        resolve_resume(cfg, tmp_path / "used")
    with pytest.raises(ValueError, match="already holds a run"):
        resolve_resume(_config(tmp_path, "used", "checkpoint.resume=none"), tmp_path / "used")
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resolve_resume(_config(tmp_path, "fresh", "checkpoint.resume=true"), tmp_path / "fresh")
    with pytest.raises(ValueError, match="not an iter_NNNNNNN"):
        resolve_resume(_config(tmp_path, "fresh", f"checkpoint.resume={tmp_path / 'nowhere'}"), tmp_path / "fresh")
