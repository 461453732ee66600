"""The demo's SAO stage with the critic from the SFT weights and a fresh value head (no value
pretraining; the recipe's critic-only warmup), from a finished `sao demo` directory, for a few steps:
the critic's explained variance at RL step 1 without value pretraining, to set beside the demo's own
(docs/pipeline.md, "Runs over seeds"). Writes DEMO_OUT/tiny_cpu/sao_novp/metrics.jsonl.

    python tools/demo_runs/critic_without_value_pretraining.py DEMO_OUT SEED STEPS
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(out: str, seed: int, steps: int) -> None:
    from megatron_sao.config import load_config
    from megatron_sao.jobs import stages
    from megatron_sao.jobs.demo_plan import DemoPlan
    from megatron_sao.jobs.train import run_train

    config = load_config("recipes/tiny_cpu.yaml", [f"run.output_dir={out}", f"run.seed={seed}"])
    base = Path(out) / config.run.name
    if not (base / "sft_hf" / "config.json").is_file():
        raise ValueError(f"{base}: no finished demo here (sft_hf missing); run `sao demo` with this output dir first")
    prepared = stages.prepare_policy_and_critic(config, DemoPlan())  # complete: every stage is skipped
    overrides = stages.rl_stage_overrides(prepared, DemoPlan())
    overrides.pop("critic.load")
    overrides.update({"critic.warmup_steps": config.critic.warmup_steps, "run.total_steps": steps,
                      "checkpoint.save_every": 0})
    stages.check_stage(run_train(stages.stage_config(config, "sao_novp", **overrides)))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python tools/demo_runs/critic_without_value_pretraining.py DEMO_OUT SEED STEPS")
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
