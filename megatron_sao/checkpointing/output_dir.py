"""Output directories that appear complete or not at all.

A conversion writes into a hidden sibling `.<name>.sao-tmp-<token>` and renames it to `<name>`
only after its last file (the manifest, or config.json for HF exports) is written and synced.
An interrupted run leaves at most that hidden directory, which no loader takes for a checkpoint.
An existing non-empty output is refused unless `overwrite`, and `overwrite` replaces only a
directory that is itself a conversion output (it has `sao_manifest.json` or `sao_export.json`),
by the same rename, so it stays intact until the new one is complete. An output that is, contains
or sits inside a source is refused whatever the flags. Free space and write permission are checked
up front; a full or read-only disk during the write is reported as such, in one line.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from megatron_sao.utils.atomic import replace_dir

TMP_MARKER = ".sao-tmp-"
# Files that mark a directory as a conversion output (mcore: the manifest; HF export: this marker).
OUTPUT_MARKERS = ("sao_manifest.json", "sao_export.json")
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


def _nearest_existing(path: Path) -> Path:
    probe = path.resolve()
    while not probe.exists():
        probe = probe.parent
    return probe


def check_output_dir(out: Path, overwrite: bool, sources: tuple[Path | None, ...] = ()) -> None:
    """Refuse an output that would destroy something: one that is, contains or sits inside a
    source (with or without `overwrite`), a file, a non-empty directory without `overwrite`, a
    non-empty directory that is not a previous conversion output even with it, and a destination
    this process cannot write."""
    target = out.resolve()
    for source in sources:
        if source is None:
            continue
        src = source.resolve()
        if target == src or target.is_relative_to(src) or src.is_relative_to(target):
            relation = ("is" if target == src else "sits inside" if target.is_relative_to(src) else "contains")
            raise ValueError(f"output {out} {relation} the source {source}: refused (with or without --overwrite), "
                             "it would overwrite the checkpoint being read; choose another --out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"output directory {out} exists and is not empty; pass --overwrite to replace it")
        if not any((out / marker).is_file() for marker in OUTPUT_MARKERS):
            raise ValueError(f"output directory {out} is not empty and is not a previous conversion output (no "
                             f"{' or '.join(OUTPUT_MARKERS)}): --overwrite replaces only conversion outputs; "
                             "remove it yourself or choose another --out")
    parent = _nearest_existing(out.parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write the output {out}: {parent} is read-only or not writable by this user")


def leftover_tmp_dirs(out: Path) -> list[Path]:
    """Hidden directories of interrupted conversions into `out` (or of one running right now)."""
    if not out.parent.is_dir():
        return []
    return sorted(p for p in out.parent.glob(f".{out.name}{TMP_MARKER}*") if p.is_dir())


def report_leftovers(out: Path, remove: bool) -> list[str]:
    """Lines about `leftover_tmp_dirs(out)`, removing them first when `remove`."""
    leftovers = leftover_tmp_dirs(out)
    if not leftovers:
        return []
    total = sum(f.stat().st_size for d in leftovers for f in d.rglob("*") if f.is_file())
    names = ", ".join(p.name for p in leftovers[:3]) + (", ..." if len(leftovers) > 3 else "")
    if remove:
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        return [f"removed {len(leftovers)} leftover temporary directories of interrupted conversions into {out} "
                f"({human_bytes(total)}): {names}"]
    return [f"note: {len(leftovers)} leftover temporary directories of interrupted conversions into {out} hold "
            f"{human_bytes(total)} in {out.parent}: {names}; --remove-leftovers deletes them (not while another "
            "conversion into the same --out is running)"]


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
        """Everything synced, then `tmp` renamed to `out`; a previous `out` is moved aside to a
        hidden `TMP_MARKER` sibling (a leftover `report_leftovers` recognises) and deleted after."""
        replace_dir(self.tmp, self.out, aside=self.out.parent / f".{self.out.name}{TMP_MARKER}old-{self.new_token()}")

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextmanager
def disk_full_as_value_error(where: Path):
    """Turn a full (ENOSPC / EDQUOT) or read-only (EROFS / EACCES / EPERM) destination met while
    writing `where` into a one-line ValueError that says so."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ValueError(f"no disk space left while writing {where}: {e}") from e
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise ValueError(f"cannot write {where}: read-only or permission denied ({e})") from e
        raise


