"""What `sao launch` checks before it writes anything: the command the job will run
(`check_driver_command`) and the launcher's fields with the job's own preflight (`check_launch`),
so that what a job would otherwise find after queueing comes out as one line (exit 2)."""

from __future__ import annotations

import shlex
from pathlib import Path

from megatron_sao.config.schema import SaoConfig
from megatron_sao.jobs.preflight import check_model_files, check_outputs, check_train_job, check_value_pretrain_job
from megatron_sao.utils.args import SaoArgumentParser

RECIPE_COMMANDS = ("train", "sft", "value-pretrain train", "value-pretrain generate", "config show")
"""`--command`s the driver runs on the resolved recipe (`sao <command> CONFIG checkpoint.resume=auto`);
`convert ...` is the other kind, run as given."""


def check_launch(config: SaoConfig, command: list[str], recipe: str) -> None:
    """`sao launch`, before anything is written: what the job would otherwise find after queueing.
    The layout against the nodes and GPUs (`sao plan`'s checks), the launcher's port range and time
    limit, the files the command reads (as paths on the shared file system) and the run directory.
    ValueError / ConfigError naming the key, flag or path."""
    from megatron_sao.jobs.plan import check_recipe_layout
    from megatron_sao.platform.slurm import job_port_block, parse_port_range
    from megatron_sao.utils.args import check_slurm_time

    launcher = config.launcher
    try:
        job_port_block(0, parse_port_range(launcher.port_range))
    except ValueError as e:
        raise ValueError(f"launcher.port_range (--port-range): {e}") from None
    try:
        check_slurm_time(launcher.time_limit)
    except ValueError as e:
        raise ValueError(f"launcher.time_limit (--time): {e}") from None
    name = " ".join(command)
    if command[0] != "convert" and name != "config show":
        check_recipe_layout(config, source=recipe)
    if name in ("train", "sft"):
        check_train_job(config, "sft" if name == "sft" else "rl")
    elif name == "value-pretrain train":
        check_value_pretrain_job(config)
    elif name == "value-pretrain generate":
        from megatron_sao.valuepretrain.settings import check_value_pretrain_config

        check_value_pretrain_config(config, for_training=False)
        check_model_files(config)
        if not Path(config.data.train_path).is_file():
            raise ValueError(f"data.train_path={config.data.train_path!r}: no such prompt file (value-pretrain "
                             "generate rolls out its prompts)")
        check_outputs(config)
    else:
        check_outputs(config)


class _ParseError(ValueError):
    pass


class _RaisingParser(SaoArgumentParser):
    """The `sao` parsers, raising instead of exiting: to check a `--command` before submitting it."""

    def error(self, message: str):  # type: ignore[override]
        raise _ParseError(message)


def check_driver_command(command: str) -> list[str]:
    """The words of `--command`, when the job can run them: a recipe command (`RECIPE_COMMANDS`) or
    a `convert` command that `sao convert`'s own parser accepts. ValueError naming the choices."""
    from megatron_sao.jobs.convert_parser import add_convert_parser

    words = shlex.split(command)
    if not words:
        raise ValueError("--command is empty: name a sao sub-command, e.g. train")
    if words[0] == "convert":
        parser = _RaisingParser(prog="sao")
        add_convert_parser(parser.add_subparsers(dest="command", required=True))
        try:
            parser.parse_args(words)
        except _ParseError as e:
            raise ValueError(f"--command {command!r}: {e}") from None
        return words
    if " ".join(words) not in RECIPE_COMMANDS:
        raise ValueError(f"--command {command!r}: not a sub-command the job can run; one of "
                         f"{', '.join(repr(c) for c in RECIPE_COMMANDS)}, or 'convert hf-to-mcore|mcore-to-hf|verify "
                         "...' (its own flags)")
    return words
