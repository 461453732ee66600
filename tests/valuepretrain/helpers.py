"""Shared pieces of the value-pretraining tests: configs, corpora and checkpoint tensors."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_sao.config import load_config
from megatron_sao.config.schema import SaoConfig

TIMING_PREFIXES = ("time/", "perf/")


def pretrain_config(tmp_path: Path, hf_dir: Path, corpus: Path, name: str, *overrides: str) -> SaoConfig:
    """Two gloo ranks, data parallel 2, K = 1, small batches; eval every 3 steps."""
    return load_config(None, [
        f"run.output_dir={tmp_path}", f"run.name={name}", f"model.hf_path={hf_dir}", "model.dtype=float32",
        "launcher.nproc_per_node=2", "logging.param_table=false", "logging.wandb_mode=disabled",
        f"value_pretrain.corpus_dir={corpus}", "data.batch_size=4", "critic.updates_per_actor_step=1",
        "critic.optim.lr=1e-3", "checkpoint.save_every=3", "checkpoint.keep_last=10", "value_pretrain.eval_every=3",
        *overrides])


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def numeric(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}
