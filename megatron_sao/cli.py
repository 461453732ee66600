"""The `sao` command: one thin sub-command per job.

    sao train RECIPE.yaml [section.key=value ...] [--dry-run]
    sao sft RECIPE.yaml [section.key=value ...] [--dry-run]
    sao config show RECIPE.yaml [section.key=value ...]
    sao config describe [SECTION]
    sao convert {hf-to-mcore,mcore-to-hf,verify} ...
    sao plan | launch | demo | online | value-pretrain | report ...   (see `sao COMMAND --help`)
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import yaml

from megatron_sao.jobs.args import add_recipe_args, load_recipe
from megatron_sao.utils.args import SaoArgumentParser


def _run_training(args: argparse.Namespace, mode: str) -> int:
    from megatron_sao.jobs.train import run_train

    if args.dry_run:
        import contextlib
        import os

        # Build as on a machine without GPUs (the local spec, meta tensors), also on a GPU node:
        # hidden before anything in this process asks CUDA for its devices.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

        from megatron_sao.jobs.dry_run import dry_run
        from megatron_sao.utils.console import console_err, console_out, default_log_path, quiet_output

        # Megatron, megatron-bridge and transformers print pages while importing and building: to
        # a log file, unless -v or the command's output is already quieted (console_out() is then
        # the terminal it started with, which is where the summary goes).
        quiet = not args.verbose and console_out() is sys.stdout
        with quiet_output(default_log_path(f"{args.command}-dry-run")) if quiet else contextlib.nullcontext():
            return dry_run(load_recipe(args), args.recipe, args.overrides, mode, console_out(), console_err())
    code, result, run_dir = run_train(load_recipe(args), mode=mode)
    metrics = result.get("metrics") or {}
    shown = ", ".join(f"{k}={metrics[k]:.4g}" for k in ("actor/loss", "critic/value_loss", "critic/explained_variance",
                                                          "train/reward_mean") if k in metrics)
    how = "stopped by a signal after its checkpoint; rerun to resume" if result.get("stopped") else "finished"
    print(f"{mode} {how} at step {result['step']} ({run_dir}){': ' + shown if shown else ''}", flush=True)
    return code


def _cmd_train(args: argparse.Namespace) -> int:
    return _run_training(args, "rl")


def _cmd_sft(args: argparse.Namespace) -> int:
    return _run_training(args, "sft")


def _cmd_config_show(args: argparse.Namespace) -> int:
    from megatron_sao.config.loader import config_to_dict

    print(yaml.safe_dump(config_to_dict(load_recipe(args)), sort_keys=False), end="")
    return 0


def _cmd_config_describe(args: argparse.Namespace) -> int:
    from megatron_sao.config.describe import describe

    print(describe(args.section))
    return 0


DRY_RUN_HELP = ("check the recipe without training: config, layout against the model, `sao plan`'s verdict, that "
                "every feature it asks for is built, and rank 0's trainer built at the real shapes in a fake world "
                "(no GPU, no memory, nothing written); exit 0 with a summary, 2 naming the key of a problem, 1 "
                "when it does not fit (docs/dry-run.md)")


def build_parser() -> argparse.ArgumentParser:
    parser = SaoArgumentParser(
        prog="sao",
        description="megatron-sao: SAO (Single-rollout Asynchronous Optimization) actor-critic RL "
                    "for MoE LLMs on Megatron-Core.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser(
        "train", help="SAO / ablation RL training of a recipe",
        description="Train the recipe's actor and critic on its trainer ranks (launcher.nproc_per_node local "
                    "processes; srun tasks inside a Slurm job with launcher.kind=slurm; Ray actors with "
                    "launcher.ray=true; NCCL on GPUs, gloo on CPU): K critic updates and one actor update per "
                    "batch of data.batch_size trajectories, run.total_steps steps. Trajectories come from "
                    "rollout.source: `recorded` reads data.trajectories_path (Parquet/JSONL of the trajectory "
                    "record) in file order; `engine` is the asynchronous pipeline: rollout engines (SGLang, or the "
                    "CPU engine) generate from the prompts of data.train_path while the trainer steps, and receive "
                    "each new actor version (docs/pipeline.md). Writes config.yaml, "
                    "metrics.jsonl, wandb (offline) and checkpoints/iter_NNNNNNN/ into run.output_dir/run.name; "
                    "resumes from the latest checkpoint there (checkpoint.resume=auto). SIGTERM/SIGINT: "
                    "checkpoint, then exit 143.")
    add_recipe_args(train)
    train.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    train.set_defaults(func=_cmd_train, quiet_log="until_started")

    sft = sub.add_parser(
        "sft", help="supervised fine-tuning of the actor on recorded trajectories",
        description="Cross-entropy on the action tokens (loss_mask) of data.trajectories_path, actor only, "
                    "run.total_steps steps of data.batch_size trajectories; same run directory, checkpoint "
                    "layout and resume rules as `sao train`. RL starts from the result with "
                    "actor.load=RUN_DIR/checkpoints.")
    add_recipe_args(sft)
    sft.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    sft.set_defaults(func=_cmd_sft, quiet_log="until_started")

    config = sub.add_parser("config", help="show a resolved recipe or describe config keys",
                            description="Inspect configuration.")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="print the fully resolved config of a recipe + overrides",
                                 description="Load, type-check and validate a recipe with overrides; "
                                             "print the resolved config as YAML.")
    add_recipe_args(show)
    show.set_defaults(func=_cmd_config_show)
    describe = config_sub.add_parser("describe", help="list config keys with types, defaults and docs",
                                     description="List config keys with their types, defaults and docs.")
    describe.add_argument("section", nargs="?", help="a section (e.g. critic) or key (e.g. algorithm.eps_low)")
    describe.set_defaults(func=_cmd_config_describe)

    from megatron_sao.jobs.convert_parser import add_convert_parser
    from megatron_sao.jobs.demo import add_demo_parser
    from megatron_sao.jobs.launch import add_launch_parser
    from megatron_sao.jobs.plan import add_plan_parser

    add_demo_parser(sub)
    from megatron_sao.jobs.online import add_online_parser

    add_online_parser(sub)
    add_convert_parser(sub)
    add_plan_parser(sub)
    add_launch_parser(sub)
    from megatron_sao.jobs.value_pretrain import add_value_pretrain_parser

    add_value_pretrain_parser(sub)
    from megatron_sao.jobs.report import add_report_parser

    add_report_parser(sub)
    from megatron_sao.jobs.study import add_study_parser

    add_study_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes (docs/exit-codes.md), the same for every sub-command: 0 success, 1 a check failed,
    2 user error (bad input, one line), 3 internal error, 130 interrupted. A sub-command whose
    parser sets `quiet_log=True` (and `--log-file`) gets third-party output sent to its log file
    unless `-v` is given; its own lines stay on the terminal (`console.console_out()`)."""
    from megatron_sao.utils.console import log_path_for, run_command

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command(f"sao {args.command}", args.func, args, log_path_for(args))


if __name__ == "__main__":
    sys.exit(main())
