"""`sao demo`: the whole recipe (convert, SFT, value pretraining, SAO through CPU engines,
held-out evaluation) end to end on the tiny model, with small stages."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_demo_runs_every_stage_and_reports_heldout_success(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_sao.cli", "demo", str(REPO / "recipes" / "tiny_cpu.yaml"),
         f"run.output_dir={tmp_path}", f"model.hf_path={tmp_path / 'hf'}", "run.total_steps=3",
         "--sft-steps", "10", "--value-steps", "4", "--heldout-prompts", "8"],
        capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"held-out success: sft=\d\.\d{3} sao=\d\.\d{3} \(8 prompts\)", lines[-1]), lines[-1]
    assert lines[-2].startswith("report: ") and Path(lines[-2].removeprefix("report: ")).is_file()
    assert re.fullmatch(r"held-out gain [+-]\d\.\d{3}; the evaluation's noise on it \(1\.96 sd, "
                        r"reporting/heldout_noise\.py\): \d\.\d{3} per tier, \d\.\d{3} pooled", lines[-3]), lines[-3]
    base = tmp_path / "tiny_cpu"
    held = json.loads((base / "heldout.json").read_text())
    assert sum(held["tier_counts"].values()) == 8 and set(held["noise"]) == {"per_tier", "pooled"}
    for stage in ("mcore", "sft", "sft_hf", "value", "value_corpus", "sao", "sao_hf"):
        assert (base / stage).is_dir(), stage
    for export in ("sft_hf", "sao_hf"):  # written by `sao convert mcore-to-hf`'s converter (its marker)
        assert (base / export / "sao_export.json").is_file(), export


@pytest.mark.timeout(600)
def test_heldout_evaluation_runs_a_gateway_scaffold_through_its_runner(tmp_path):
    """The demo's held-out evaluation with `rollout.environment=openai_scaffold`: each episode runs
    the scaffold against the gateway (`rollout/serving.py` picks `ScaffoldRunner`), one trajectory
    per prompt in the prompts' order, scored by the verifier. Before the shared composition the
    evaluation built an `AgentLoop`, whose `reset` of a scaffold environment raised TypeError:
    every episode FAILED, success 0."""
    from megatron_sao.config import load_config
    from megatron_sao.jobs.demo import rollout_heldout, success_by_tier, tier_counts
    from megatron_sao.rollout.datasets import load_prompts
    from megatron_sao.rollout.envs.calc import write_calc_dataset
    from megatron_sao.rollout.trajectory import TrajectoryStatus
    from tests.rollout.engine_helpers import tiny_checkpoint
    from tests.rollout.gateway.helpers import one_call_scaffold_overrides

    hf_dir = tiny_checkpoint()
    config = load_config(None, [f"run.output_dir={tmp_path}", f"model.hf_path={hf_dir}", "model.dtype=float32",
                                "rollout.engine=cpu", "rollout.max_new_tokens_per_turn=8",
                                "rollout.max_total_tokens=512", "rollout.max_inflight_per_engine=4",
                                *one_call_scaffold_overrides(tmp_path)])
    samples = load_prompts(write_calc_dataset(tmp_path / "heldout.jsonl", 3, seed=1)).samples
    trajectories = rollout_heldout(config, hf_dir, samples, tmp_path / "engine_logs")
    assert [t.prompt_id for t in trajectories] == [s.prompt_id for s in samples]
    assert all(t.status == TrajectoryStatus.COMPLETED for t in trajectories), [t.status_reason for t in trajectories]
    assert success_by_tier(trajectories)["all"] == 1.0
    assert sum(tier_counts(trajectories).values()) == 3
