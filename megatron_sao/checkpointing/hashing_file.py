"""Output files that hash what is written to them, so a manifest's digests cost no second read.

A conversion writes as many bytes as it reads, and every file it writes is listed in the manifest
with its digest (`digest.py`): `HashingFile` feeds each byte to the digest on its way to the file.
Plain buffered writes through the page cache, synced by `finish`. `kick` marks the end of an item
(a tensor); here it does nothing, and `fastio.writeback.WritebackHashingFile` starts the disk's
write-back of the item there (behind the fast-I/O switch, docs/conversion.md#fast-io).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megatron_sao.checkpointing.digest import DEFAULT as DEFAULT_DIGEST
from megatron_sao.checkpointing.digest import new_hasher


class HashingFile:
    """A new binary file, written sequentially, with the digest of its bytes."""

    def __init__(self, path: str | Path, digest: str = DEFAULT_DIGEST) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 - closed by finish / close
        self._digest = new_hasher(digest)

    def write(self, data: Any) -> int:
        self._digest.update(data)
        return self._file.write(data)

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def kick(self) -> None:
        """An item is complete (the fast-I/O variant starts its write-back here)."""

    def finish(self) -> tuple[int, str]:
        """Flush, fsync and close; returns (bytes, digest hex)."""
        self._file.flush()
        size = self._file.tell()
        os.fsync(self._file.fileno())
        self._file.close()
        return size, self._digest.hexdigest()

    def close(self) -> None:
        self._file.close()
