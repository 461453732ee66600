"""`sao online RECIPE`: online mode on the tiny task, SAO's critic vs a running-mean baseline.

The recipe's reward shifts during the run (`rollout.environment: calc_shift`: the preferred
answer changes phase by phase, by the prompt's position in the stream). The demo's stages 1-3
(`sao demo`'s convert, SFT, value pretraining; reused when they exist) give the SFT policy and the
value-pretrained critic, with one difference: the SFT demonstrations are written in both styles
(`calc_shift.mixed_oracle`, `rollout.environment_kwargs.demonstration_echo_share` of them `echo`),
so the policy's own samples include both and RL can follow either preference. Two RL runs then
see the same prompt stream and the same shifts:

    critic         SAO as the recipe says (skip-observation GAE on the critic's values)
    running_mean   the same, advantages = reward - mean of the last 128 rewards (the paper's
                   online baseline: `algorithm.advantage=running_mean`, global scope)

then `sao report` of both runs side by side (reporting/compare.py): smoothed reward with the
phase boundaries, and per phase the reward just after the shift, at its end, and the steps until
90% of that level. The last lines name the comparison page and summarise the adaptation.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_sao.config.schema import SaoConfig
from megatron_sao.jobs.stages import DemoPlan, two_operand_plan

BASELINE_WINDOW = 128


def run_online(config: SaoConfig, plan: DemoPlan | None = None) -> int:
    from megatron_sao.jobs.stages import check_stage, prepare_policy_and_critic, say, stage_config
    from megatron_sao.jobs.train import run_train
    from megatron_sao.reporting.compare import write_comparison
    from megatron_sao.rollout.envs.calc_shift import SHIFT_KEYS, CalcShiftConfig, mixed_oracle

    rollout = config.rollout
    if rollout.environment != "calc_shift":
        raise ValueError(f"rollout.environment={rollout.environment!r}: `sao online` needs a shifting reward "
                         "(rollout.environment: calc_shift, see recipes/tiny_cpu_online.yaml)")
    shift = CalcShiftConfig.from_kwargs(**rollout.environment_kwargs)  # a clear error now, not in the rollout
    phases = list(shift.phases)
    if shift.phase_length % config.data.batch_size:
        raise ValueError(f"rollout.environment_kwargs.phase_length={shift.phase_length} must be a multiple of "
                         f"data.batch_size={config.data.batch_size} (phases are drawn as whole steps)")
    phase_steps = shift.phase_length // config.data.batch_size
    calc_kwargs = {k: v for k, v in rollout.environment_kwargs.items() if k not in SHIFT_KEYS}
    plain = replace(config, rollout=replace(rollout, environment="calc", environment_kwargs=calc_kwargs))
    plan = plan or two_operand_plan()  # the shifting reward is defined on the two-operand problems
    if plan.teacher is None:  # SFT on both styles, so the policy's own samples can follow either preference
        plan = replace(plan, teacher=mixed_oracle(shift.demonstration_echo_share))
    prepared = prepare_policy_and_critic(plain, plan)

    runs: dict[str, Path] = {}
    for name, overrides in (("critic", {}),
                            ("running_mean", {"algorithm.advantage": "running_mean",
                                              "algorithm.running_mean_scope": "global",
                                              "algorithm.running_mean_window": BASELINE_WINDOW})):
        say(f"[online] {name}: {len(phases)} phases {phases} of {phase_steps} steps")
        stage = stage_config(config, f"online_{name}", **{
            "model.hf_path": prepared.sft_hf, "critic.load": prepared.critic_checkpoints,
            "rollout.source": "engine", "data.train_path": prepared.train_prompts, "critic.warmup_steps": 0,
            "run.total_steps": phase_steps * len(phases), **overrides})
        check_stage(run_train(stage))
        runs[name] = prepared.base / f"online_{name}"
    comparison = write_comparison(runs, prepared.base / "online_report", phase_steps=phase_steps)
    for name, stats in comparison.phases.items():
        summary = "; ".join(f"phase {i} ({phases[i]}): {s.early:.2f} -> {s.late:.2f}"
                            f" (90% after {'-' if s.recovery_steps is None else s.recovery_steps} steps)"
                            for i, s in enumerate(stats))
        say(f"{name}: {summary}")
    say(f"comparison: {comparison.page}")
    return 0


def add_online_parser(subparsers: Any) -> None:
    import argparse

    parser = subparsers.add_parser(
        "online", help="online mode: a reward that shifts in phases, SAO's critic vs a running-mean baseline",
        description=__doc__.split("\n\n")[0] + " Reuses the demo's SFT and value-pretraining stages (same "
                    "run directory), then two RL runs on the shifting reward and a side-by-side report.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML file (recipes/tiny_cpu_online.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of recipe values")
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: the demo's)")
    parser.add_argument("--value-steps", type=int, default=None, help="value-pretraining steps (default: the demo's)")
    parser.add_argument("--log-file", help="where third-party output goes (default: a new file in the temp "
                                           "directory, named on error); -v keeps it on the terminal")
    parser.set_defaults(quiet_log=True)

    def run(args: argparse.Namespace) -> int:
        from megatron_sao.config import load_config

        plan = two_operand_plan()
        if args.sft_steps is not None:
            plan.sft_steps = args.sft_steps
        if args.value_steps is not None:
            plan.value_steps = args.value_steps
        return run_online(load_config(args.recipe, args.overrides), plan)

    parser.set_defaults(func=run)
