"""The demo's SAO stage again, from a finished `sao demo` directory (same SFT policy, same critic
start), under a new name, with evaluation during training on 256 of the held-out prompts every 25
steps (`eval/success/<tier>`), then the final policy on all held-out prompts. Prints each
evaluation per tier and the final line (docs/pipeline.md, "A ninth run went the other way").

    cd DIR_OF_THE_DEMO && python tools/demo_runs/repeat_rl_stage.py OUTPUT_DIR SEED NAME [KEY=VALUE ...]

OUTPUT_DIR and SEED as the demo ran (`run.output_dir`, `run.seed`); KEY=VALUE overrides the stage
(e.g. `pipeline.max_buffered=32`).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace


def main(out: str, seed: int, name: str, overrides: list[str]) -> None:
    from megatron_sao.config import load_config
    from megatron_sao.jobs import stages
    from megatron_sao.jobs.demo import rollout_heldout, success_by_tier
    from megatron_sao.jobs.demo_plan import DemoPlan
    from megatron_sao.jobs.train import run_train
    from megatron_sao.rollout.datasets import write_prompts

    config = load_config("recipes/tiny_cpu.yaml", [f"run.output_dir={out}", f"run.seed={seed}"])
    plan = DemoPlan()
    prepared = stages.prepare_policy_and_critic(config, plan)  # complete: every stage is skipped
    base = prepared.base
    settings = stages.rl_stage_overrides(prepared, plan)
    settings.update({"eval.every_n_steps": 25, "eval.num_prompts": 256,
                     "eval.prompts_path": write_prompts(base / "heldout_prompts.jsonl", prepared.heldout)})
    settings.update(dict(item.split("=", 1) for item in overrides))
    stage = stages.stage_config(config, name, **settings)
    start = time.time()
    stages.check_stage(run_train(stage))
    trained = replace(stage, actor=replace(stage.actor, load=str(stages.latest_checkpoint(base / name))))
    final = success_by_tier(rollout_heldout(stage, stages.export_actor(trained, base / f"{name}_hf"),
                                            prepared.heldout, base / f"eval_{name}"))
    rows = [json.loads(line) for line in (base / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        if "eval/success" in row:
            tiers = {k.split("/")[-1]: round(v, 3) for k, v in row.items() if k.startswith("eval/success")}
            print(f"eval at step {row['eval/step']:.0f}: {tiers}")
    staleness = sum(row["staleness/mean"] for row in rows) / len(rows)
    print(f"{name}: held-out {json.dumps({k: round(v, 3) for k, v in final.items()})}, staleness mean "
          f"{staleness:.2f}, {time.time() - start:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: python tools/demo_runs/repeat_rl_stage.py OUTPUT_DIR SEED NAME [KEY=VALUE ...]")
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
