"""Command output that shows the result, and the exit codes of every `sao` command.

Megatron, megatron-bridge, transformers and torch print warnings, log lines and even tracebacks
while they import and build models (15-50 lines per `sao convert`, none of them actionable).
`quiet_output(log)` points file descriptors 1 and 2 at a log file for the duration of a command,
so all of it lands there: Python warnings, library logging, `print`s, C/C++ messages, and the
output of worker processes spawned meanwhile (they inherit the descriptors). The command's own
lines go to `console_out()` / `console_err()`, the terminal the command started with; its result
is its last line. `-v` keeps everything on the terminal instead.

Exit codes (docs/exit-codes.md), the same for every command run through `run_command`:
0 success, 1 a check failed (e.g. `sao convert verify` above tolerance), 2 user error (bad
input: a `ValueError`, `NotImplementedError` or `ConfigError`, reported on one line), 3 internal
error (anything else: one line on the terminal, the traceback in the log), 130 interrupted.

This module is generic (nothing conversion-specific); it lives here because the conversion CLI
is its first user.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 3
EXIT_INTERRUPTED = 130
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, NotImplementedError)

_console: list[tuple[TextIO, TextIO]] = []  # stack of (stdout, stderr) of active quiet_output()s
_releases: list[list[Callable[[], None]]] = []  # per quiet_output(): [restore] until it has run
_until_started: list[bool] = []  # per quiet_output(): whether `show_output()` may run its restore early


def console_out() -> TextIO:
    """Where a command prints its own lines (the original stdout while output is quieted)."""
    return _console[-1][0] if _console else sys.stdout


def console_err() -> TextIO:
    """Where a command prints progress and errors (the original stderr while output is quieted)."""
    return _console[-1][1] if _console else sys.stderr


def default_log_path(command: str) -> Path:
    """`$TMPDIR/sao-<command>-<time>-<pid>.log`: a fresh file per run, kept after it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.gettempdir()) / f"sao-{command.replace(' ', '-')}-{stamp}-{os.getpid()}.log"


def log_path_for(args: Any) -> Path | None:
    """The log file of a command whose parser set `quiet_log` (True: for the whole command;
    "until_started": until the command calls `show_output()`): `args.log_file`, else a new
    `default_log_path`; None (output stays on the terminal) for other commands and with `-v`."""
    if not getattr(args, "quiet_log", False) or getattr(args, "verbose", False):
        return None
    if getattr(args, "log_file", None):
        return Path(args.log_file)
    names = [getattr(args, "command", None), getattr(args, "convert_command", None)]
    return default_log_path("-".join(str(n) for n in names if n))


def show_output() -> None:
    """Point fds 1 and 2 back at the terminal now, when the innermost `quiet_output` was opened with
    `until_started=True`; otherwise nothing. A job calls it when its checks are done and its own
    work starts: the third-party output of its imports and checks (warnings before a one-line
    error) stays in the log, what its ranks print while they train is seen live."""
    if _releases and _releases[-1] and _until_started[-1]:
        _releases[-1].pop()()


def output_quieted() -> bool:
    """Whether fds 1 and 2 go to a log file right now."""
    return bool(_releases) and bool(_releases[-1])


@contextlib.contextmanager
def quiet_output(log_path: Path, until_started: bool = False) -> Iterator[Path]:
    """Send everything written to fds 1 and 2 (this process and its children) to `log_path`
    (appended); `console_out()` / `console_err()` stay on the original ones. With
    `until_started`, `show_output()` ends that early."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    out = os.fdopen(os.dup(saved[0]), "w", buffering=1, encoding="utf-8", errors="replace")
    err = os.fdopen(os.dup(saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    # Python-level writes too, even where sys.stdout / sys.stderr were replaced (pytest, IDEs).
    python_streams = (sys.stdout, sys.stderr)
    log_stream = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    sys.stdout = sys.stderr = log_stream

    def restore() -> None:
        sys.stdout, sys.stderr = python_streams
        log_stream.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)

    _console.append((out, err))
    _releases.append([restore])
    _until_started.append(until_started)
    try:
        yield log_path
    finally:
        _console.pop()
        _until_started.pop()
        if _releases.pop():  # not run early by show_output()
            restore()
        for fd in saved:
            os.close(fd)
        out.close()
        err.close()


def run_command(prog: str, func: Callable[[Any], int | None], args: Any, log_path: Path | None = None) -> int:
    """Run `func(args)` and map its outcome to the documented exit codes. With `log_path`,
    third-party output goes there (`quiet_output`; for the whole command, or until it calls
    `show_output()` when `args.quiet_log == "until_started"`) and the terminal shows only the
    command's own lines; the last one is the result or the error."""
    until_started = getattr(args, "quiet_log", None) == "until_started"
    with quiet_output(log_path, until_started) if log_path is not None else contextlib.nullcontext() as log:
        try:
            return int(func(args) or 0)
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=console_err(), flush=True)
            return EXIT_INTERRUPTED
        except USER_ERRORS as e:
            if details := getattr(e, "tracebacks", None):  # a rank's user error: where it came from, for -v
                logging.getLogger(__name__).debug("%s", details)
            kind = "config error" if type(e).__name__ == "ConfigError" else "error"
            print(f"{prog}: {kind}: {e}", file=console_err(), flush=True)
            return EXIT_USER_ERROR
        except Exception as e:
            traceback.print_exc()  # into the log when quiet, else on the terminal above the line below
            where = f"; the traceback is in {log}" if log is not None and output_quieted() else ""
            first = (str(e).strip().splitlines() or [""])[0]
            print(f"{prog}: internal error: {type(e).__name__}: {first}{where}", file=console_err(), flush=True)
            return EXIT_INTERNAL_ERROR
