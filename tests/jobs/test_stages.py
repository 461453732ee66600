"""jobs/stages.py, the stages `sao demo` / `online` / `study` share: the conversion stage calls the
converter itself (before: a `sao convert` subprocess whose stdout the demo parsed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sao.checkpointing.manifest import MANIFEST_FILE
from megatron_sao.jobs.stages import convert_to_mcore

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # one conversion on a spawned process: ~35 s on the 2-core box under load
@pytest.mark.timeout(600)
def test_conversion_stage_runs_the_converter_once(tiny_hf_dir, tmp_path, capsys):
    out = tmp_path / "mcore"
    assert convert_to_mcore(tiny_hf_dir, out) == out
    said = capsys.readouterr().out.strip().splitlines()
    assert said[-1].startswith("hf-to-mcore: ") and (out / MANIFEST_FILE).is_file()
    assert convert_to_mcore(tiny_hf_dir, out) == out and capsys.readouterr().out == ""  # complete: skipped
    with pytest.raises(ValueError, match=f"--hf {out} is a Megatron checkpoint"):  # the converter's own check
        convert_to_mcore(out, tmp_path / "again")


def test_heldout_prompts_are_disjoint_from_training_prompts_and_demonstrations(tmp_path):
    from megatron_sao.jobs.demo_plan import DemoPlan, demonstration_samples, prompt_files
    from megatron_sao.rollout.datasets import load_prompts

    plan = DemoPlan(num_train_prompts=400, num_heldout_prompts=300, num_demonstrations=400)
    train_path, heldout = prompt_files(tmp_path, plan, seed=3)
    expressions = {s.metadata["expression"] for s in heldout}
    assert len(heldout) == 300 and len(expressions) > 250  # t0's small space repeats a few
    assert not expressions & {s.metadata["expression"] for s in load_prompts(train_path).samples}
    demonstrated = {s.metadata["expression"] for s in demonstration_samples(plan, seed=3)}
    assert not expressions & demonstrated
    # The demo's default: demonstrations on the three shorter tiers, prompts on all four.
    tiers = {s.metadata["tier"] for s in heldout}
    assert tiers == {t.name for t in plan.calc_tiers}
    assert {s.metadata["tier"] for s in demonstration_samples(plan, seed=3)} == tiers - {plan.calc_tiers[-1].name}


def test_sft_stage_keeps_a_constant_rate(tmp_path):
    """The recipe's decaying actor schedule is RL's: the demo's SFT stage resolves to a constant rate."""
    from megatron_sao.config import load_config
    from megatron_sao.jobs.demo_plan import DemoPlan
    from megatron_sao.jobs.stages import sft_stage_overrides, stage_config

    config = load_config(REPO / "recipes" / "tiny_cpu.yaml", [f"run.output_dir={tmp_path}"])
    assert (config.actor.optim.lr_decay_style, config.actor.optim.min_lr) == ("cosine", 2e-5)
    plan = DemoPlan()
    sft = stage_config(config, "sft", **sft_stage_overrides(plan, tmp_path / "d.parquet", tmp_path / "mcore"))
    assert (sft.actor.optim.lr_decay_style, sft.actor.optim.min_lr, sft.actor.optim.lr) == ("constant", 0.0,
                                                                                           plan.sft_lr)
    assert sft.run.total_steps == plan.sft_steps
