"""The on-disk layout of training checkpoints: directory names, the tracker, the manifest, pruning.

    <checkpoints_dir>/
      latest_checkpointed_iteration.txt   the step of the newest complete checkpoint (written last)
      iter_0000006/                       one complete checkpoint (step = completed train steps)
        actor/  critic/                   torch_dist directories (model, optimizer, scheduler, RNG)
        trainer_state.json                the caller's state (data position, baseline, counters)
        sao_checkpoint.json               manifest: layout, roles, per-file size + SHA-256 (last file)
      iter_0000009.partial/               a save in progress, or one killed mid-way: never loaded

Completeness is structural: a save writes into `iter_XXXXXXX.partial/`, and only a directory
renamed to its final name after its manifest was written and synced counts. The tracker is a
hint that saves a directory scan; when it is missing or names a directory that is gone, the
newest complete directory is used instead. Nothing here is collective; `checkpoint.py` decides
which rank calls what.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_sao.checkpointing.digest import digest_file, entry_digest
from megatron_sao.checkpointing.manifest import library_versions, sha256_file, tree_checksum
from megatron_sao.utils.atomic import atomic_write_text, fsync_path, replace_dir

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "sao_checkpoint.json"
TRAINER_STATE_FILE = "trainer_state.json"
PARTIAL_SUFFIX = ".partial"
FORMAT = "sao-train-checkpoint-v1"
ROLES = ("actor", "critic")
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_NAMES = {"sha256": "SHA-256", "xxh3_128": "xxh3-128"}


@dataclass(kw_only=True)
class CheckpointManifest:
    """What `sao_checkpoint.json` records about one complete checkpoint."""

    step: int
    """Completed train steps when it was written (the directory's number)."""
    roles: list[str]
    """Role directories it holds (actor, and critic unless the run has none)."""
    layout: dict[str, int]
    """Parallel layout and world size at save; RNG states are restored only into the same one."""
    optimizer_format: dict[str, str]
    """role -> how its optimizer state is stored (distributed optimizer sharding type, or `plain`)."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Relative path -> {bytes, sha256} of every file of the checkpoint but this manifest."""
    checksum: str = ""
    """SHA-256 over the sorted `path sha256` lines of `files`."""
    versions: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def iter_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"iter_{step:07d}"


def step_of(path: Path) -> int | None:
    """The step of a final (not partial) iter directory name, else None."""
    match = _ITER_RE.match(path.name)
    return int(match.group(1)) if match else None


def partial_dir(checkpoints_dir: Path, step: int) -> Path:
    return checkpoints_dir / (iter_dir_name(step) + PARTIAL_SUFFIX)


def read_tracker(checkpoints_dir: Path) -> int | None:
    """The step the tracker names, or None when it is absent or unreadable (logged)."""
    path = checkpoints_dir / TRACKER_FILE
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        logger.warning("%s: unreadable contents %r; scanning for the newest complete checkpoint", path, text[:40])
        return None
    return int(text)


def write_tracker(checkpoints_dir: Path, step: int) -> None:
    atomic_write_text(checkpoints_dir / TRACKER_FILE, f"{step}\n")


def is_complete(iter_dir: Path) -> bool:
    return step_of(iter_dir) is not None and (iter_dir / MANIFEST_FILE).is_file()


def complete_iter_dirs(checkpoints_dir: Path) -> list[Path]:
    """Complete iter directories, oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: step_of(p) or 0)


def find_latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The newest COMPLETE iter dir: the tracker's when it names one, else the newest on disk."""
    checkpoints_dir = Path(checkpoints_dir)
    step = read_tracker(checkpoints_dir)
    if step is not None:
        named = checkpoints_dir / iter_dir_name(step)
        if is_complete(named):
            return named
        logger.warning("%s names step %d but %s is not a complete checkpoint; using the newest complete one",
                       checkpoints_dir / TRACKER_FILE, step, named.name)
    complete = complete_iter_dirs(checkpoints_dir)
    return complete[-1] if complete else None


def read_manifest(iter_dir: Path) -> CheckpointManifest:
    """The manifest of a complete checkpoint; ValueError naming the directory otherwise."""
    path = iter_dir / MANIFEST_FILE
    if not path.is_file():
        raise ValueError(f"{iter_dir}: no {MANIFEST_FILE}: not a complete megatron-sao training checkpoint "
                         "(a save killed mid-way leaves an iter_*.partial directory)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: corrupt checkpoint manifest ({e})") from e
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {data.get('format')!r}, this version reads {FORMAT!r}")
    return CheckpointManifest(**data)


def write_manifest(directory: Path, manifest: CheckpointManifest) -> None:
    manifest.checksum = tree_checksum(manifest.files)
    manifest.versions = library_versions()
    atomic_write_text(directory / MANIFEST_FILE, json.dumps(asdict(manifest), indent=1, sort_keys=True) + "\n")


def list_files(root: Path) -> list[str]:
    """Relative paths of every file under `root` but the manifest, sorted (every rank sees the same list)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def my_share(names: list[str], rank: int, world: int) -> list[str]:
    """File i is this rank's when i % world == rank: hashing and verifying are split across ranks."""
    return [name for i, name in enumerate(names) if i % world == rank]


def hash_and_sync(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {bytes, sha256}} of `names` under `root`, each file fsynced on the way."""
    table = {}
    for name in names:
        path = root / name
        fsync_path(path)
        table[name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return table


def verify_files(root: Path, files: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    """Errors (each naming the file) for `names` that are missing, resized or changed since the save."""
    errors = []
    for name in names:
        path, meta = root / name, files[name]
        if not path.is_file():
            errors.append(f"{path}: checkpoint file missing (listed in the manifest)")
        elif path.stat().st_size != meta["bytes"]:
            errors.append(f"{path}: checkpoint file is {path.stat().st_size} bytes, the manifest records "
                          f"{meta['bytes']} (truncated or replaced)")
        else:
            algorithm, recorded = entry_digest(meta)  # SHA-256 here; xxh3-128 in a conversion output
            if digest_file(path, algorithm) != recorded:
                errors.append(f"{path}: checkpoint file is corrupt ({_NAMES[algorithm]} differs from the one "
                              "recorded at save)")
    return errors


def commit(partial: Path, final: Path) -> None:
    """Make `partial` the complete checkpoint `final` (everything synced, renamed, the directory
    synced). A previous `final` (the same step saved again) is moved aside to `<final>.old-<pid>`
    (a leftover `prune` recognises) and deleted only after the rename."""
    replace_dir(partial, final, aside=final.with_name(final.name + f".old-{os.getpid()}"))


def prune(checkpoints_dir: Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep_last` (<= 0 keeps all), and leftovers of
    killed saves older than the newest complete one. Returns what was deleted."""
    complete = complete_iter_dirs(checkpoints_dir)
    doomed = complete[:-keep_last] if keep_last > 0 else []
    newest = step_of(complete[-1]) if complete else None
    if newest is not None:
        for p in checkpoints_dir.iterdir():
            base = p.name.removesuffix(PARTIAL_SUFFIX).split(".old-")[0]
            leftover = p.name != base and p.is_dir()
            if leftover and (s := step_of(Path(base))) is not None and s < newest:
                doomed.append(p)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("deleted checkpoint %s", path)
    return doomed
