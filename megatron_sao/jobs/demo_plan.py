"""What the demo's stages are sized by and trained on (`sao demo`, `sao online`, `sao study`): the
plan (`DemoPlan`), the training and held-out prompts, the SFT demonstrations."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_sao.config.schema import SaoConfig
from megatron_sao.rollout.envs.calc import (
    CALC_TIERS,
    CalcTier,
    generate_calc_samples,
    make_calc,
    oracle_action,
    write_calc_split,
)


@dataclass(kw_only=True)
class DemoPlan:
    """The sizes of the stages (the recipe gives the model, layout, RL settings and run.total_steps)."""

    num_train_prompts: int = 2048
    num_heldout_prompts: int = 1024
    """Held-out prompts (disjoint from the training prompts and the SFT demonstrations): 1024 puts
    the evaluation's noise on a gain at ~0.04 (1.96 x the binomial sd of a difference near 0.6)."""
    num_demonstrations: int = 1024
    sft_steps: int = 300
    sft_lr: float = 1e-3
    sft_batch_size: int = 32
    value_prompts: int = 96
    value_samples_per_prompt: int = 4
    value_steps: int = 40
    ray: bool = True
    """Run the SAO stage with its trainer ranks and engines placed on a local Ray instance (the
    placement clusters use); false: local processes."""
    teacher: Any = None
    """The SFT demonstration writer, `(sample, observations) -> action`; None: `calc.oracle_action`
    (`sao online` passes `calc_shift.mixed_oracle`, demonstrations in both styles)."""
    calc_tiers: tuple[CalcTier, ...] | None = CALC_TIERS
    """Difficulty tiers of the prompts (training, held-out): success depends on the prompt, so the
    critic has something to predict (docs/pipeline.md, "The task"). None: the original two-operand
    problems (`sao online`'s shifting reward is defined on them)."""
    demonstration_tiers: tuple[CalcTier, ...] | None = CALC_TIERS[:3]
    """Tiers of the SFT demonstrations (None: `calc_tiers`). The demo leaves the longest tier out:
    the SFT policy never solves it, so about a quarter of the prompts fail whatever is sampled and
    the critic learns which (explained variance 0.5-0.7 in RL); RL improves the other three."""


def two_operand_plan() -> DemoPlan:
    """The plan on the original two-operand problems (`sao online`; the demo before the tiers):
    SFT 200 steps, 128 held-out prompts."""
    return DemoPlan(calc_tiers=None, demonstration_tiers=None, sft_steps=200, num_heldout_prompts=128)


def prompt_files(base: Path, plan: DemoPlan, seed: int) -> tuple[Path, list[Any]]:
    """Training prompts (JSONL) and held-out prompts that repeat no training prompt and no SFT
    demonstration (`calc.write_calc_split`)."""
    demonstrated = {s.metadata["expression"] for s in demonstration_samples(plan, seed)}
    return write_calc_split(base / "train_prompts.jsonl", plan.num_train_prompts, plan.num_heldout_prompts, seed,
                            tiers=plan.calc_tiers, exclude=demonstrated)


def demonstration_samples(plan: DemoPlan, seed: int) -> list[Any]:
    """The prompts of the SFT demonstrations (held-out prompts exclude them)."""
    return generate_calc_samples(plan.num_demonstrations, seed + 7, tiers=plan.demonstration_tiers or plan.calc_tiers)


def demonstrations_file(config: SaoConfig, base: Path, plan: DemoPlan, seed: int) -> Path:
    from transformers import AutoTokenizer

    from megatron_sao.rollout.demonstrations import demonstrations
    from megatron_sao.rollout.trajectory_io import write_parquet

    path = base / "demonstrations.parquet"
    if not path.is_file():
        samples = demonstration_samples(plan, seed)
        records = demonstrations(samples, make_calc(**config.rollout.environment_kwargs), plan.teacher or oracle_action,
                                 AutoTokenizer.from_pretrained(config.model.hf_path), config.rollout.max_turns)
        write_parquet(path, records)
    return path
