"""`actor.load` / `critic.load`: start a role from the weights of an existing Megatron checkpoint.

Accepted paths: a run's checkpoints directory (its latest complete checkpoint), an
`iter_NNNNNNN` directory, one role directory inside it, or a `sao convert hf-to-mcore` output.
Only the model weights are read (no optimizer, scheduler or RNG state: a new run), and they
reshard into any layout. Files are checked against the checkpoint's recorded digests first
(SHA-256 in a run's checkpoint, xxh3-128 in a conversion output), each rank checking a share; the
weights then load through Megatron's standard `dist_checkpointing.load` under the keys both
training and conversion save them under (`checkpointing.keys.model_state`), as `load_checkpoint`
loads a resume. Nothing of conversion's own I/O (`checkpointing/fastio/`, `mcore_io`) is used.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from megatron_sao.checkpointing import manifest as convert_manifest
from megatron_sao.checkpointing.keys import model_state, unwrap
from megatron_sao.platform.collective import raise_if_any, rank, world_size
from megatron_sao.training.checkpoint import files

logger = logging.getLogger(__name__)


def resolve_weights_dir(path: Path, role: str) -> tuple[Path, Path, dict[str, dict[str, Any]]]:
    """(directory to load, root the file table is relative to, {relative path: {bytes, <digest>}} of the
    files to check) for `path`; ValueError naming `path` when it is no accepted kind."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{role}.load={path}: no such directory")
    if (path / convert_manifest.MANIFEST_FILE).is_file():
        manifest = convert_manifest.read_manifest(path)
        if manifest.role != role:
            raise ValueError(f"{role}.load={path}: a converted {manifest.role} checkpoint, not a {role} one"
                             + (" (convert the actor with `sao convert hf-to-mcore --role critic`)"
                                if role == "critic" else ""))
        return path, path, manifest.files
    iter_dir = None
    if files.step_of(path) is not None:
        iter_dir = path
    elif path.name in files.ROLES and files.step_of(path.parent) is not None:
        if path.name != role:
            raise ValueError(f"{role}.load={path}: that is the {path.name}'s directory, not the {role}'s")
        iter_dir = path.parent
    elif (path / files.TRACKER_FILE).is_file() or any(files.step_of(p) is not None for p in path.iterdir()):
        iter_dir = files.find_latest_checkpoint(path)
        if iter_dir is None:
            raise ValueError(f"{role}.load={path}: a checkpoints directory without any complete checkpoint")
    if iter_dir is None:
        raise ValueError(f"{role}.load={path}: not a megatron-sao checkpoint: expected a run's checkpoints "
                         f"directory (with {files.TRACKER_FILE}), an iter_NNNNNNN directory, its actor/ or critic/ "
                         f"directory, or a `sao convert hf-to-mcore` output (with {convert_manifest.MANIFEST_FILE})")
    manifest = files.read_manifest(iter_dir)
    if role not in manifest.roles:
        raise ValueError(f"{role}.load={path}: checkpoint {iter_dir.name} holds {manifest.roles}, no {role}")
    prefix = f"{role}/"
    table = {k: v for k, v in manifest.files.items() if k.startswith(prefix)}
    return iter_dir / role, iter_dir, table


def load_model_weights(path: Path, role: str, chunks: list) -> Path:
    """Collective. For `actor.load` / `critic.load`: weights only, into any layout. Returns the
    directory actually loaded.

    Call it before building the role's optimizer (or call the optimizer's `reload_model_params()`
    after): with bf16 weights the optimizer keeps its own fp32 copies.
    """
    from megatron.core import dist_checkpointing

    directory, root, table = resolve_weights_dir(Path(path), role)
    convert_manifest.check_dist_checkpoint_files(directory)
    names = sorted(table)
    raise_if_any(files.verify_files(root, table, files.my_share(names, rank(), world_size())))
    models = [unwrap(c) for c in chunks]
    state = model_state(models)
    loaded = dist_checkpointing.load(state, str(directory))  # Megatron's default torch_dist load strategy
    for key, model in zip(state, models, strict=True):  # "model" or "model0", "model1", ...: in chunk order
        model.load_state_dict(loaded[key], strict=True)
    logger.info("%s: loaded weights from %s", role, directory)
    return directory
