"""What the trainer does not build yet, in one place.

`SaoTrainer.__init__` calls `check_features_built` before it builds anything, and
`sao train --dry-run` calls the same function, so a recipe that the dry run passes cannot ask
for something the trainer refuses at start. A feature that gets built is removed here (and only
here); one that gets refused is added here, naming the key that asks for it.
"""

from __future__ import annotations

from typing import Literal

from megatron_sao.config.schema import SaoConfig

Mode = Literal["rl", "sft", "critic"]


def unbuilt_features(config: SaoConfig, mode: Mode = "rl") -> list[str]:
    """One line per feature `config` asks for that the trainer (in `mode`) does not build, each
    naming the key and how to avoid it; empty when everything asked for is built."""
    problems: list[str] = []  # everything the recipes ask for is built (context parallelism: issue 29)
    return problems


def check_features_built(config: SaoConfig, mode: Mode = "rl") -> None:
    """NotImplementedError (a user error: exit 2 from `sao`) naming the first unbuilt feature."""
    problems = unbuilt_features(config, mode)
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
        raise NotImplementedError(problems[0] + more)
