"""The manifest of a megatron-sao mcore checkpoint directory, and the directory's layout.

    <dir>/                       a megatron.core.dist_checkpointing (torch_dist) checkpoint:
      metadata.json .metadata __*_*.distcp common.pt
      hf/                        config.json, tokenizer, generation config of the source (no weights)
      hf_passthrough/            HF tensors Megatron has no place for (e.g. MTP layers), verbatim
      sao_manifest.json          written last: role, tensor tables, file sizes and checksums

The manifest is what makes `mcore-to-hf` need nothing else: the HF tensor table (names, shapes,
dtypes) is the exact output of the export, the Megatron tensor table documents the checkpoint,
and per-file sizes and digests (with one checksum over them all) let a reader tell a complete
checkpoint from a partial copy before loading anything. Format v2 records xxh3-128 digests
(`digest.py` says why); v1 (SHA-256) manifests are still read.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_sao.checkpointing.digest import DEFAULT as DEFAULT_DIGEST
from megatron_sao.checkpointing.digest import digest_file

FORMAT = "sao-mcore-v2"
_READABLE = {"sao-mcore-v1": "sha256", FORMAT: None}
"""format -> the digest its manifests use when they do not name one (None: they name it)."""
MANIFEST_FILE = "sao_manifest.json"
HF_DIR = "hf"
PASSTHROUGH_DIR = "hf_passthrough"
_REQUIRED_DIST_FILES = ("metadata.json", ".metadata")


@dataclass(kw_only=True)
class Manifest:
    role: str
    """actor or critic."""
    architecture: str
    """The causal-LM architecture (HF `architectures[0]`) of the trunk."""
    params_dtype: str
    """dtype the Megatron parameters are stored in (torch name)."""
    source: str
    """The HF directory converted from."""
    source_format: str
    """causal_lm, or the critic format name (critic_format.CRITIC_FORMAT)."""
    layout: dict[str, int]
    """TP/PP/EP/ETP and world size at conversion (the checkpoint reshards on load)."""
    hf_tensors: dict[str, dict[str, Any]]
    """name -> {dtype (safetensors code), shape}: exactly what `mcore-to-hf` writes."""
    passthrough: list[str] = field(default_factory=list)
    """HF tensors stored verbatim in hf_passthrough/ (not in the Megatron model)."""
    value_head: dict[str, Any] | None = None
    """Critic only: how the value head was obtained (loaded from the source, or initialised)."""
    mcore_tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    """dist-checkpoint key -> {dtype, shape} (global shapes)."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """relative path -> {bytes, <digest>: hex} of every file but the manifest."""
    checksum: str = ""
    """SHA-256 over the sorted `path <digest hex>` lines of `files`."""
    digest: str = DEFAULT_DIGEST
    """The files' digest algorithm (`digest.ALGORITHMS`), also the key of each file's entry."""
    versions: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def sha256_file(path: Path, chunk_bytes: int = 4 * 1024 * 1024) -> str:
    return digest_file(path, "sha256", chunk_bytes)


def hash_tree(root: Path, known: dict[str, tuple[int, str]] | None = None,
              algorithm: str = DEFAULT_DIGEST) -> dict[str, dict[str, Any]]:
    """{relative path: {bytes, <algorithm>: hex}} of every file under `root` except the manifest.
    `known` holds (bytes, digest) of files hashed while they were written; they are not read again."""
    known = known or {}
    table = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
        name = str(path.relative_to(root))
        size = path.stat().st_size
        if name in known:
            assert known[name][0] == size, (name, known[name], size)
            table[name] = {"bytes": size, algorithm: known[name][1]}
        else:
            table[name] = {"bytes": size, algorithm: digest_file(path, algorithm)}
    return table


def tree_checksum(files: dict[str, dict[str, Any]], algorithm: str = "sha256") -> str:
    """SHA-256 over the sorted `path <digest>` lines (`algorithm` names the entries' digest)."""
    lines = "".join(f"{name} {meta[algorithm]}\n" for name, meta in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "megatron-core", "megatron-bridge", "transformers", "megatron-sao"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out


def write_manifest(directory: Path, manifest: Manifest, known: dict[str, tuple[int, str]] | None = None) -> None:
    """Hash the directory's files (those not in `known`, see `hash_tree`) into the manifest and
    write it (the checkpoint's last file)."""
    manifest.files = hash_tree(directory, known, manifest.digest)
    manifest.checksum = tree_checksum(manifest.files, manifest.digest)
    (directory / MANIFEST_FILE).write_text(json.dumps(asdict(manifest), indent=1) + "\n")


def read_manifest(directory: Path) -> Manifest:
    """The manifest of `directory`; ValueError if it is absent (not ours, or an incomplete conversion)."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such directory")
    path = directory / MANIFEST_FILE
    if not path.is_file():
        hint = (" (it is the temporary directory of an interrupted conversion)" if ".sao-tmp-" in directory.name
                else "")
        raise ValueError(f"{directory}: no {MANIFEST_FILE}: not a megatron-sao mcore checkpoint, or an "
                         f"incomplete one{hint}; pass --hf-config to export a bare dist checkpoint")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: corrupt manifest ({e})") from e
    if data.get("format") not in _READABLE:
        raise ValueError(f"{path}: manifest format {data.get('format')!r}, this version reads "
                         f"{' and '.join(map(repr, _READABLE))}")
    default_digest = _READABLE[data["format"]]
    if default_digest is not None:
        data.setdefault("digest", default_digest)
    try:
        manifest = Manifest(**data)
    except TypeError as e:
        raise ValueError(f"{path}: corrupt manifest ({e})") from e
    bad = [name for name, meta in manifest.files.items() if manifest.digest not in meta or "bytes" not in meta]
    if bad:
        raise ValueError(f"{path}: corrupt manifest: the entry of {bad[0]!r} lacks its bytes or "
                         f"{manifest.digest} digest")
    return manifest


def check_dist_checkpoint_files(directory: Path) -> None:
    """A bare dist checkpoint must have its metadata files; name the first one missing."""
    for name in _REQUIRED_DIST_FILES:
        if not (directory / name).is_file():
            raise ValueError(f"{directory}: missing checkpoint file {name} (not a torch_dist checkpoint, or "
                             "a partial copy)")


def check_files(directory: Path, manifest: Manifest, verify_hashes: bool) -> None:
    """Every file the manifest lists is present with its size (and digest when `verify_hashes`)."""
    check_dist_checkpoint_files(directory)
    for name, meta in sorted(manifest.files.items()):
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{directory}: missing checkpoint file {name} (listed in {MANIFEST_FILE})")
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise ValueError(f"{path}: partial checkpoint file: {size} bytes, the manifest records {meta['bytes']}")
    if verify_hashes:
        errors = checksum_errors(directory, manifest, sorted(manifest.files))
        if errors:
            raise ValueError(errors[0])


def checksum_errors(directory: Path, manifest: Manifest, names: list[str],
                    known: Mapping[str, str] | None = None) -> list[str]:
    """One line per file of `names` whose digest differs from the manifest's; `known`: digests
    already computed (by a load that hashed the files as it read them), the rest are hashed here."""
    known = known or {}
    recorded = {name: manifest.files[name][manifest.digest] for name in names}
    return [f"{directory / name}: checksum mismatch (file changed or corrupt since conversion)"
            for name in names if (known.get(name) or digest_file(directory / name, manifest.digest)) != recorded[name]]


def checksum_share(manifest: Manifest, rank: int, world_size: int,
                   saved_by: Callable[[str], int | None] | None = None) -> list[str]:
    """The files `rank` hashes when `world_size` ranks split the work (largest first, each to the
    rank with the fewest bytes so far: the same answer on every rank). With `saved_by`, a file goes
    to the rank that wrote it (a rank loading what it saved reads it anyway and hashes it in the
    same pass with fast I/O: `fastio.distcp_stream`) while that rank holds less than an even share
    of the bytes."""
    load = [0] * world_size
    even = sum(meta["bytes"] for meta in manifest.files.values()) / world_size
    mine = []
    for name in sorted(manifest.files, key=lambda n: (-manifest.files[n]["bytes"], n)):
        owner = saved_by(name) if saved_by is not None else None
        if owner is None or not 0 <= owner < world_size or load[owner] >= even:
            owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += manifest.files[name]["bytes"]
        if owner == rank:
            mine.append(name)
    return mine


def check_checkpoint_kinds(hf: str | None, mcore: str | None) -> None:
    """`--hf` names a HuggingFace directory and `--mcore` a Megatron one (a conversion output, with
    its manifest): ValueError naming the flag that points at the other kind, or both when swapped."""
    hf_is_mcore = hf is not None and (Path(hf) / MANIFEST_FILE).is_file()
    mcore_is_hf = (mcore is not None and (Path(mcore) / "config.json").is_file()
                   and not (Path(mcore) / MANIFEST_FILE).is_file())
    if hf_is_mcore and mcore_is_hf:
        raise ValueError(f"--hf and --mcore are swapped: --hf {hf} is a Megatron checkpoint ({MANIFEST_FILE}) and "
                         f"--mcore {mcore} a HuggingFace one (config.json); use --hf {mcore} --mcore {hf}")
    if hf_is_mcore:
        raise ValueError(f"--hf {hf} is a Megatron checkpoint (it holds {MANIFEST_FILE}), not a HuggingFace directory")
    if mcore_is_hf:
        raise ValueError(f"--mcore {mcore} is a HuggingFace checkpoint (config.json, no {MANIFEST_FILE}), not a "
                         "`sao convert hf-to-mcore` output")
