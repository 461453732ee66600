"""The `sao` command: help for every command, fast config errors, and `sao train` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sao.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")


def _subcommands(parser):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            yield from action.choices.items()


def test_every_command_has_help(capsys):
    parser = build_parser()
    stack = [((), parser)]
    seen = []
    while stack:
        path, p = stack.pop()
        with pytest.raises(SystemExit) as exit_info:
            main([*path, "--help"])
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert "usage: sao" in text and len(text) > 80
        seen.append(" ".join(path))
        stack.extend(((*path, name), sub) for name, sub in _subcommands(p))
    assert {"train", "sft", "config", "config show", "config describe"} <= set(seen)


def test_train_help_is_not_stale(capsys):
    """Issue 27 finding 11: the help said the engine source was "not built yet"."""
    texts = {}
    for command in ("train", "sft"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        texts[command] = " ".join(capsys.readouterr().out.split())
        assert "not built" not in texts[command] and "--dry-run" in texts[command]
    assert "`engine` is the asynchronous pipeline" in texts["train"]


def test_bad_override_fails_fast_naming_the_key():
    proc = subprocess.run([sys.executable, "-m", "megatron_sao.cli", "train", TINY, "model.num_experts=abc"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "model.num_experts" in proc.stderr and "abc" in proc.stderr


def test_config_show_prints_resolved_yaml(capsys):
    assert main(["config", "show", TINY, "critic.updates_per_actor_step=3"]) == 0
    out = capsys.readouterr().out
    assert "updates_per_actor_step: 3" in out


# The metric keys the trainer issue fixes (other tools read them).
CONTRACT_KEYS = ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/lr", "actor/dis_masked_low_frac",
                 "actor/dis_masked_high_frac", "critic/value_loss", "critic/explained_variance", "critic/grad_norm",
                 "critic/grad_norm/attention", "critic/grad_norm/experts", "critic/lr", "critic/optimizer_steps",
                 "moe/max_over_mean_load", "perf/tokens_per_s", "time/critic_s", "time/actor_s", "time/data_s",
                 "train/skipped_steps")


# Slow (default-suite time, issue 28): sao train end to end: tests/pipeline/test_ray_placement.py
# (Ray) and tests/pipeline/test_engine_lifetime.py.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_job_end_to_end(tmp_path):
    """The README's main job (shortened): tiny MoE actor + critic on 2 gloo ranks (EP2), recorded
    trajectories, real steps, checkpoints, metrics with every contract key."""
    from megatron_sao.rollout.trajectory_io import write_parquet
    from tests.training.trajectories import random_trajectories

    recorded = tmp_path / "recorded.parquet"
    write_parquet(recorded, random_trajectories(12, seed=2))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_sao.cli", "train", TINY, "run.total_steps=2", f"run.output_dir={tmp_path}",
         f"model.hf_path={tmp_path / 'hf'}", f"data.trajectories_path={recorded}", "critic.warmup_steps=1",
         "data.batch_size=4"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("rl finished at step 2")
    run_dir = tmp_path / "tiny_cpu"
    assert (run_dir / "config.yaml").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "actor/loss" not in rows[0]  # critic warmup: step 1 updates only the critic
    missing = [k for k in CONTRACT_KEYS if k not in rows[-1]]
    assert not missing, missing
    assert [r["critic/optimizer_steps"] for r in rows] == [2, 4]
    assert (run_dir / "checkpoints" / "iter_0000002" / "actor").is_dir()
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb offline run missing"
    assert "critic parameters" in proc.stderr and "attention" in proc.stderr
