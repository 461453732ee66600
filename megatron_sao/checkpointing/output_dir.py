"""Output directories that appear complete or not at all.

A conversion writes into a hidden sibling `.<name>.sao-tmp-<token>` and renames it to `<name>`
only after its last file (the manifest, or config.json for HF exports) is written and synced.
An interrupted run leaves at most that hidden directory, which no loader takes for a checkpoint.
An existing non-empty output is refused unless `overwrite`; it is then replaced by the same
rename, so it stays intact until the new one is complete. Free space is checked up front, and a
full disk during the write is reported as such.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

TMP_MARKER = ".sao-tmp-"
# Headroom on top of the payload: metadata, manifests, filesystem block rounding.
_SPACE_MARGIN = 1.02
_SPACE_SLACK_BYTES = 64 * 1024 * 1024


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def disk_free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing ancestor)."""
    probe = path.resolve()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_disk_space(out: Path, payload_bytes: int) -> None:
    need = int(payload_bytes * _SPACE_MARGIN) + _SPACE_SLACK_BYTES
    free = disk_free_bytes(out.parent)
    if free < need:
        raise ValueError(f"not enough disk space for {out}: the conversion writes about {human_bytes(need)}, "
                         f"{out.parent} has {human_bytes(free)} free")


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse an output path that is a file, or a non-empty directory without `overwrite`."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"output directory {out} exists and is not empty; pass --overwrite to replace it")


def leftover_tmp_dirs(out: Path) -> list[Path]:
    """Hidden directories of interrupted conversions into `out`."""
    if not out.parent.is_dir():
        return []
    return sorted(out.parent.glob(f".{out.name}{TMP_MARKER}*"))


@dataclass(slots=True)
class StagedOutput:
    """`out` staged in a temporary sibling; `commit` makes it appear, `abort` removes it."""

    out: Path
    tmp: Path

    @classmethod
    def new_token(cls) -> str:
        return uuid.uuid4().hex[:12]

    @classmethod
    def for_token(cls, out: Path, token: str) -> StagedOutput:
        return cls(out=out, tmp=out.parent / f".{out.name}{TMP_MARKER}{token}")

    def create(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir()

    def commit(self) -> None:
        _fsync_tree(self.tmp)
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}{TMP_MARKER}old-{self.new_token()}"
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        _fsync_dir(self.out.parent)
        if old is not None:
            shutil.rmtree(old)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextmanager
def disk_full_as_value_error(where: Path):
    """Turn ENOSPC / EDQUOT raised while writing `where` into a ValueError that says so."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ValueError(f"no disk space left while writing {where}: {e}") from e
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))
