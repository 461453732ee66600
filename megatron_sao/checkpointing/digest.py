"""File digests recorded in checkpoint manifests.

A manifest's digests tell a complete, intact checkpoint from a partial copy or a flipped bit before
anything is loaded; they are not signatures (the manifest sits next to the files it describes), so
the hash only has to be a good checksum. `xxh3_128` runs at ~7.8 GB/s on one core of the 2-core
CI VM against SHA-256's ~1.0 GB/s (with SHA-NI), and a conversion hashes every byte it writes:
SHA-256 alone held a bare checksummed copy to 0.52x of the disk's speed there (docs/conversion.md).
`sha256` is kept to read manifests written before it (format sao-mcore-v1).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import xxhash


class Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...
    def hexdigest(self) -> str: ...


ALGORITHMS: dict[str, Callable[[], Hasher]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
DEFAULT = "xxh3_128"


def new_hasher(algorithm: str) -> Hasher:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown digest {algorithm!r} (known: {sorted(ALGORITHMS)})")
    return ALGORITHMS[algorithm]()


def digest_file(path: Path, algorithm: str = DEFAULT, chunk_bytes: int = 4 * 1024 * 1024) -> str:
    digest = new_hasher(algorithm)
    buffer = bytearray(chunk_bytes)  # one buffer, reused: no allocation per block
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def entry_digest(entry: dict[str, Any]) -> tuple[str, str]:
    """(algorithm, hex digest) of a manifest's file entry `{bytes, <algorithm>: hex}`."""
    for algorithm in ALGORITHMS:
        if algorithm in entry:
            return algorithm, entry[algorithm]
    raise ValueError(f"file entry {entry} has no digest (known: {sorted(ALGORITHMS)})")
