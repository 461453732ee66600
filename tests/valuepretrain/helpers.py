"""Shared pieces of the value-pretraining tests: configs, corpora and checkpoint tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

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


def checkpoint_tensors(role_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist role directory (model and optimizer state), by flat key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{role_dir.parent.parent.parent.name}_{role_dir.parent.name}_{role_dir.name}.pt"
    dcp_to_torch_save(role_dir, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix.rstrip(".")] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def numeric(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}
