"""Command-line parsing shared by every `sao` parser: no abbreviated options, checked numbers.

`SaoArgumentParser` turns off argparse's prefix matching of long options (`--node` would
otherwise be taken for `--nodes`, `--js` for `--json`): a mistyped flag is an error, never
another flag. Sub-command parsers inherit the class (`add_subparsers` builds them with the
parent's type). The `type=` functions below reject a number outside its range at parse time, as
one argparse error line (exit 2), instead of deep inside a job.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any


class SaoArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with `allow_abbrev=False` unless told otherwise."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse `type=`: an integer >= `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def float_in(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """An argparse `type=`: a finite number >= `low` (> `low` with `low_open`) and <= `high`."""
    bounds = (f"> {low:g}" if low_open else f">= {low:g}") + ("" if high == math.inf else f" and <= {high:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}, got {text}")
        return value

    parse.__name__ = f"number {bounds}"
    return parse


_SLURM_TIME = re.compile(r"(\d+)|(\d+):(\d{1,2})|(\d+):(\d{1,2}):(\d{1,2})|(\d+)-(\d+)(:\d{1,2}(:\d{1,2})?)?")


def check_slurm_time(text: str) -> str:
    """A Slurm time limit (sbatch --time): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or UNLIMITED / INFINITE.
    ValueError naming the forms otherwise (a zero limit included)."""
    value = text.strip()
    if value.upper() in ("UNLIMITED", "INFINITE"):
        return value
    if not _SLURM_TIME.fullmatch(value) or not any(c in "123456789" for c in value):
        raise ValueError(f"time limit {text!r} is not a Slurm time: use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                         "D-HH:MM:SS (above zero), or UNLIMITED")
    return value


def slurm_time(text: str) -> str:
    """An argparse `type=` for `check_slurm_time`."""
    try:
        return check_slurm_time(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def byte_size(text: str) -> int:
    """An argparse `type=`: a size as HuggingFace writes them (`5GB`, `500MB`, `1024`), in bytes
    (powers of 1000)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB)")
    return int(float(match[1]) * 1000 ** " KMGT".index(match[2] or " "))
