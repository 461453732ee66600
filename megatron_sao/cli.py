"""The `sao` command: one thin sub-command per job.

    sao train RECIPE.yaml [section.key=value ...]
    sao smoke RECIPE.yaml [section.key=value ...]
    sao config show RECIPE.yaml [section.key=value ...]
    sao config describe [SECTION]
    sao convert {hf-to-mcore,mcore-to-hf,verify} ...
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import yaml

OVERRIDES_HELP = ("dotted overrides of recipe values, e.g. actor.optim.lr=2e-6 parallelism.tensor=2 "
                  "critic.frozen=[attention,router]; see `sao config describe`")


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML file (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


def _load(args: argparse.Namespace):
    from megatron_sao.config import load_config

    return load_config(args.recipe, args.overrides)


def _cmd_smoke(args: argparse.Namespace, config=None) -> int:
    from megatron_sao.smoke import run_smoke
    from megatron_sao.utils.run_logging import prepare_run_dir

    config = config or _load(args)
    run_dir = prepare_run_dir(config)
    print(f"run directory: {run_dir} (resolved config: {run_dir / 'config.yaml'})", flush=True)
    history = run_smoke(config, run_dir)
    last = history[-1] if history else {}
    print(f"smoke run finished: {len(history)} steps; last step: "
          + ", ".join(f"{k}={v:.4g}" for k, v in last.items() if isinstance(v, float)), flush=True)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    config = _load(args)
    print("NOTE: the SAO trainer (rollout + critic/actor steps) is not built yet (trainer issue); "
          "`sao train` runs the foundation smoke run on this recipe: real Megatron actor and "
          "critic, real optimizer steps, synthetic data.", flush=True)
    return _cmd_smoke(args, config)


def _cmd_config_show(args: argparse.Namespace) -> int:
    from megatron_sao.config.loader import config_to_dict

    print(yaml.safe_dump(config_to_dict(_load(args)), sort_keys=False), end="")
    return 0


def _cmd_config_describe(args: argparse.Namespace) -> int:
    from megatron_sao.config.describe import describe

    print(describe(args.section))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sao",
        description="megatron-sao: SAO (Single-rollout Asynchronous Optimization) actor-critic RL "
                    "for MoE LLMs on Megatron-Core.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="run a recipe (today: the foundation smoke run, see its help)",
                           description="Run a training recipe. Until the SAO trainer lands this runs "
                                       "the foundation smoke run (see `sao smoke --help`).")
    _add_recipe_args(train)
    train.set_defaults(func=_cmd_train)

    smoke = sub.add_parser("smoke", help="build the recipe's actor and critic and take a few optimizer steps",
                           description="Build the recipe's Megatron actor and critic (on "
                                       "launcher.nproc_per_node local processes, gloo on CPU), then run "
                                       "run.total_steps steps on synthetic sequences: K critic steps and one "
                                       "DIS-style actor step each. Writes config.yaml, metrics.jsonl and "
                                       "wandb (offline) files into run.output_dir/run.name.")
    _add_recipe_args(smoke)
    smoke.set_defaults(func=_cmd_smoke)

    config = sub.add_parser("config", help="show a resolved recipe or describe config keys",
                            description="Inspect configuration.")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="print the fully resolved config of a recipe + overrides",
                                 description="Load, type-check and validate a recipe with overrides; "
                                             "print the resolved config as YAML.")
    _add_recipe_args(show)
    show.set_defaults(func=_cmd_config_show)
    describe = config_sub.add_parser("describe", help="list config keys with types, defaults and docs",
                                     description="List config keys with their types, defaults and docs.")
    describe.add_argument("section", nargs="?", help="a section (e.g. critic) or key (e.g. algorithm.eps_low)")
    describe.set_defaults(func=_cmd_config_describe)

    try:
        from megatron_sao.checkpointing.convert_cli import add_convert_parser
    except ImportError as e:  # the conversion CLI is optional only while it is being built
        logging.getLogger(__name__).debug("convert CLI unavailable: %s", e)
    else:
        add_convert_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from megatron_sao.config import ConfigError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"sao: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
