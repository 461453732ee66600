"""`sao study RECIPE`: the paper's ablations at a size this box runs, from one common start.

Stages 1-3 of the demo (SFT, value pretraining; shared with `sao demo` on the same recipe, so a
demo already run is reused) give one start; then, for every seed and every variant, the demo's SAO
stage with the variant's settings on top, all at the same number of sampled trajectories
(`run.total_steps` x `data.batch_size`), each with evaluation during training; then a final
held-out evaluation of every run's policy and of the SFT policy on the same prompts. Written into
`<run.output_dir>/<run.name>/study/`: one run directory per variant and seed, `study.md` (the
table, the figure, the paper's claims side by side), `study.png`, `study.json`
(`reporting/study.py` defines every number). Re-running skips finished runs.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_sao.config.schema import SaoConfig

logger = logging.getLogger(__name__)

GRPO = {"algorithm.advantage": "grpo", "algorithm.group_size": 8}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "sao": ("SAO (K=2, frozen attention)", {}),
    "sao_k1": ("SAO, K=1", {"critic.updates_per_actor_step": 1}),
    "sao_full_critic": ("SAO, full-parameter critic", {"critic.frozen": "[]"}),
    "sao_no_value_pretrain": ("SAO without value pretraining", {"critic.load": ""}),
    # PPO's ratio against the engine's log-probs (the behaviour policy, as DIS): clipped at
    # [1 - 0.2, 1 + 0.28] (clip-higher) where DIS masks outside [0.7, 6].
    "grpo": ("GRPO (group 8, PPO clip + clip-higher)", {**GRPO, "algorithm.policy_loss": "ppo_clip",
                                                        "algorithm.old_logprobs": "rollout"}),
    "grpo_dis": ("GRPO + DIS (group 8)", {**GRPO, "algorithm.policy_loss": "dis"}),
    "running_mean": ("running-mean baseline (per prompt, window 8)", {"algorithm.advantage": "running_mean"}),
}
"""name -> (label, overrides on top of the demo's SAO stage)."""


def variant_overrides(config: SaoConfig, name: str) -> dict[str, Any]:
    """The variant's overrides; without value pretraining the critic starts from the SFT weights
    with a fresh value head and gets the recipe's critic-only warmup, as the paper's SAO does."""
    _, overrides = VARIANTS[name]
    if name == "sao_no_value_pretrain":
        overrides = {**overrides, "critic.warmup_steps": config.critic.warmup_steps}
    return overrides


def run_study(config: SaoConfig, seeds: list[int], variants: list[str], plan: Any, eval_every: int,
              eval_prompts: int, command: str) -> Path:
    from megatron_sao.jobs.demo import rollout_heldout, success_by_tier, tier_counts
    from megatron_sao.jobs.stages import (
        check_stage,
        export_actor,
        latest_checkpoint,
        prepare_policy_and_critic,
        rl_stage_overrides,
        say,
        stage_config,
    )
    from megatron_sao.jobs.train import run_train
    from megatron_sao.reporting.heldout_noise import evaluation_sd
    from megatron_sao.reporting.study import setup_text, summarise_run, write_study
    from megatron_sao.rollout.datasets import write_prompts

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"sao study: unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    prepared = prepare_policy_and_critic(config, plan)
    out = prepared.base / "study"
    out.mkdir(parents=True, exist_ok=True)
    heldout_path = write_prompts(out / "heldout_prompts.jsonl", prepared.heldout)
    base_rl = stage_config(config, "sao", **rl_stage_overrides(prepared, plan))

    sft_file = out / "sft_heldout.json"
    if not sft_file.is_file():
        say(f"[study] SFT policy on {len(prepared.heldout)} held-out prompts")
        tiers = success_by_tier(rollout_heldout(base_rl, prepared.sft_hf, prepared.heldout, out / "eval_sft"))
        sft_file.write_text(json.dumps(tiers) + "\n")
    sft_heldout = json.loads(sft_file.read_text())["all"]

    counts = tier_counts(prepared.heldout)
    summaries: dict[str, list[Any]] = {v: [] for v in variants}
    load_before = os.getloadavg()
    for seed in seeds:
        for variant in variants:
            name = f"{variant}-s{seed}"
            run_dir = out / name
            final = run_dir / "final.json"
            if not final.is_file():
                say(f"[study] {name}: {VARIANTS[variant][0]}, seed {seed}")
                overrides = {**rl_stage_overrides(prepared, plan), **variant_overrides(config, variant),
                             "run.seed": seed, "eval.every_n_steps": eval_every, "eval.num_prompts": eval_prompts,
                             "eval.prompts_path": heldout_path}
                rl = stage_config(config, name, under=out, **overrides)
                start = time.perf_counter()
                check_stage(run_train(rl))
                wall = time.perf_counter() - start
                hf = export_actor(replace(rl, actor=replace(rl.actor, load=str(latest_checkpoint(run_dir)))),
                                   run_dir / "final_hf")
                tiers = success_by_tier(rollout_heldout(rl, hf, prepared.heldout, run_dir / "eval_final"))
                final.write_text(json.dumps({"heldout": tiers["all"], "by_tier": tiers, "wall_s": wall}) + "\n")
            result = json.loads(final.read_text())
            summary = summarise_run(variant, seed, run_dir / "metrics.jsonl", result["heldout"], sft_heldout,
                                    result["wall_s"], evaluation_sd(result["by_tier"], counts))
            summaries[variant].append(summary)
            say(f"[study] {name}: held-out {summary.heldout:.3f} (SFT {sft_heldout:.3f}), critic EV (last 20) "
                 f"{'n/a' if summary.ev_last20 is None else f'{summary.ev_last20:.2f}'}")
    load_after = os.getloadavg()
    setup = setup_text(base_rl, seeds, len(prepared.heldout), eval_every, eval_prompts, load_before, load_after)
    labels = {v: VARIANTS[v][0] for v in variants}
    page = write_study(out, summaries, labels, sft_heldout, len(prepared.heldout), command, setup)
    say(f"study: {page}")
    return page


def add_study_parser(subparsers: Any) -> None:
    import argparse

    from megatron_sao.jobs.demo_plan import DemoPlan

    parser = subparsers.add_parser(
        "study", help="the paper's ablations at small scale: SAO variants, GRPO, GRPO + DIS, running mean",
        description=__doc__.split("\n\n")[0] + " Variants: " + ", ".join(VARIANTS) + ". Writes study.md (table, "
                    "figure, the paper's claims side by side), study.png and study.json into "
                    "RUN.OUTPUT_DIR/RUN.NAME/study/; re-running skips finished runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML file (recipes/tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of recipe values")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated RL seeds (default 1,2,3)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    parser.add_argument("--eval-every", type=int, default=15, help="evaluation during training every N steps")
    parser.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts per evaluation during "
                                                                       "training (the final one uses all)")
    parser.add_argument("--heldout-prompts", type=int, default=DemoPlan.num_heldout_prompts)
    parser.add_argument("--sft-steps", type=int, default=DemoPlan.sft_steps, help="SFT steps of the common start")
    parser.add_argument("--value-steps", type=int, default=DemoPlan.value_steps,
                        help="value pretraining steps of the common start")
    parser.add_argument("--log-file", help="where third-party output goes (default: a new file in the temp "
                                           "directory, named on error); -v keeps it on the terminal")
    parser.set_defaults(quiet_log=True)

    def run(args: argparse.Namespace) -> int:
        from megatron_sao.config import load_config
        from megatron_sao.rollout.envs.calc import CALC_TIERS

        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        plan = DemoPlan(calc_tiers=CALC_TIERS, num_heldout_prompts=args.heldout_prompts, sft_steps=args.sft_steps,
                        value_steps=args.value_steps)
        command = "sao study " + " ".join(shlex.quote(a) for a in sys.argv[sys.argv.index("study") + 1:]) \
            if "study" in sys.argv else "sao study " + args.recipe
        run_study(load_config(args.recipe, args.overrides), seeds, variants, plan, args.eval_every,
                  args.eval_prompts, command)
        return 0

    parser.set_defaults(func=run)
