"""Arguments every recipe sub-command shares (`sao train|sft|config show|value-pretrain ...`).

Public so that `cli.py` and the job modules that register their own sub-commands
(`jobs/value_pretrain.py`) add the same positional recipe, overrides and `--log-file` without
importing each other: the parser lives in `cli.py`, the jobs below it, and nothing in `jobs/`
imports `cli`.
"""

from __future__ import annotations

import argparse

from megatron_sao.config.schema import SaoConfig

OVERRIDES_HELP = ("dotted overrides of recipe values, e.g. actor.optim.lr=2e-6 parallelism.tensor=2 "
                  "critic.frozen=[attention,router]; see `sao config describe`")


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    """RECIPE, KEY=VALUE overrides and `--log-file` (read by `utils.console.log_path_for`)."""
    parser.add_argument("recipe", help="recipe YAML file (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    parser.add_argument("--log-file", help="where third-party output of the checks before the run goes (default: a "
                                           "new file in the temp directory); -v keeps it on the terminal")


def load_recipe(args: argparse.Namespace) -> SaoConfig:
    """The resolved config of `args.recipe` with `args.overrides` (ConfigError naming the key)."""
    from megatron_sao.config import load_config

    return load_config(args.recipe, args.overrides)
