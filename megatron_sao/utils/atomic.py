"""Files and directories that appear complete or not at all: the one way this project writes them.

A file is written to a hidden temporary sibling (`.<name>.<token>.tmp`, same directory, so the
rename stays on one filesystem), then renamed over its final name: a reader sees the old content
or the new, never half of it, and a killed writer leaves only the temporary (a hidden `*.tmp`).
With `durable` (the default) the file is fsynced before the rename and its directory after, so the
new content survives a crash of the machine too, not only of the process; callers whose output is
worthless after a crash (a report page, a result passed between processes) skip it.

A directory is built under a staging name by the caller and made to appear by `replace_dir`: an
existing directory of the final name is moved aside first and deleted only after the rename.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"


def fsync_path(path: str | Path) -> None:
    """fsync a file, or a directory (so the entries created or renamed in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and directory under `root`, `root` last."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def temporary_sibling(path: str | Path) -> Path:
    """A new hidden name next to `path`, ending in `TMP_SUFFIX` (a killed writer's leftovers match
    `.*.tmp`)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")


@contextmanager
def atomic_path(path: str | Path, *, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path to write `path`'s new content to (by any means: a library writing to
    a path, several writes, reading it back to hash it); on a normal exit it replaces `path`
    (fsynced first with `durable`), on an exception it is removed and `path` is untouched."""
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str, *, durable: bool = True, encoding: str = "utf-8") -> None:
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_text(text, encoding=encoding)


def atomic_write_json(path: str | Path, data: Any, *, durable: bool = True, indent: int | None = 1,
                      sort_keys: bool = False) -> None:
    """`data` as JSON (NaN and infinities refused: they are not JSON), newline-terminated."""
    atomic_write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys, allow_nan=False) + "\n",
                      durable=durable)


def replace_dir(staging: str | Path, final: str | Path, *, durable: bool = True,
                aside: str | Path | None = None) -> None:
    """Make the complete directory `staging` appear as `final` (same filesystem). An existing
    `final` is renamed to `aside` first (default: a hidden sibling) and deleted only once `staging`
    has taken its place, so a crash leaves the old or the new directory under `final`, never
    neither for longer than one rename. With `durable`, everything under `staging` is fsynced
    first and the parent directory after."""
    staging, final = Path(staging), Path(final)
    if durable:
        fsync_tree(staging)
    old = None
    if final.exists():
        old = Path(aside) if aside is not None else final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.old")
        os.replace(final, old)
    os.replace(staging, final)
    if durable:
        fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
