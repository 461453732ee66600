"""The `sao` command: help for every command, fast config errors, and the smoke job end to end."""

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
    assert {"train", "smoke", "config", "config show", "config describe"} <= set(seen)


def test_bad_override_fails_fast_naming_the_key():
    proc = subprocess.run([sys.executable, "-m", "megatron_sao.cli", "train", TINY, "model.num_experts=abc"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "model.num_experts" in proc.stderr and "abc" in proc.stderr


def test_config_show_prints_resolved_yaml(capsys):
    assert main(["config", "show", TINY, "critic.updates_per_actor_step=3"]) == 0
    out = capsys.readouterr().out
    assert "updates_per_actor_step: 3" in out


@pytest.mark.timeout(600)
def test_smoke_job_end_to_end(tmp_path):
    """The README's main job (shortened): tiny MoE actor + critic on 2 gloo ranks (EP2), real steps."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_sao.cli", "smoke", TINY, "run.total_steps=3", f"run.output_dir={tmp_path}",
         f"model.hf_path={tmp_path / 'hf'}"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "tiny_cpu"
    assert (run_dir / "config.yaml").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["critic/grad_norm_0"] > 0 and r["critic/grad_norm_1"] > 0 for r in rows)
    assert "actor/grad_norm" not in rows[0]  # critic warmup: step 0 updates only the critic
    assert all(r["actor/grad_norm"] > 0 for r in rows[1:])
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb offline run missing"
    assert "critic parameters" in proc.stderr and "attention" in proc.stderr
