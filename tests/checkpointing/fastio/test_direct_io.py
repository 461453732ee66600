"""O_DIRECT checkpoint writes: the same bytes and digests as through the page cache, at any offset
and size, with fallbacks where the filesystem refuses O_DIRECT."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from megatron_sao.checkpointing.fastio import direct_io
from megatron_sao.checkpointing.fastio.direct_io import (
    ALIGN,
    DirectHashingFile,
    PositionalWriter,
    hashing_file,
    open_direct,
)
from megatron_sao.checkpointing.hashing_file import HashingFile
from tests.checkpointing._helpers import refuse_direct_io


@pytest.fixture
def small_bounce(monkeypatch):
    monkeypatch.setattr(direct_io, "BOUNCE_BYTES", 4 * ALIGN)  # several drains per test


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    fd = open_direct(tmp_path / "probe", os.O_WRONLY | os.O_CREAT)
    if fd is None:
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT")
    os.close(fd)
    return tmp_path


def _pieces(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [1, 7, ALIGN - 1, ALIGN, 4 * ALIGN, 4 * ALIGN + 3, 10 * ALIGN + 17, 0, 100]
    return [rng.randbytes(n) for n in sizes]


@pytest.mark.parametrize("tail", [b"", b"x" * 5])
def test_direct_file_writes_the_same_bytes_and_digest_as_the_page_cache_file(direct_dir, small_bounce, tail):
    direct, plain = hashing_file(direct_dir / "direct"), HashingFile(direct_dir / "plain")
    assert isinstance(direct, DirectHashingFile)
    for piece in [*_pieces(0), tail]:
        assert direct.write(memoryview(piece)) == len(piece)
        plain.write(piece)
        assert direct.tell() == plain.tell()
        direct.kick()
    assert direct.finish() == plain.finish()
    assert (direct_dir / "direct").read_bytes() == (direct_dir / "plain").read_bytes()


def test_a_filesystem_refusing_direct_opens_gets_a_page_cache_file(tmp_path, monkeypatch):
    from megatron_sao.checkpointing.fastio.writeback import WritebackHashingFile

    monkeypatch.setattr(direct_io, "open_direct", lambda *args, **kwargs: None)
    stream = hashing_file(tmp_path / "f")
    assert isinstance(stream, WritebackHashingFile)
    stream.write(b"abc")
    stream.kick()
    assert stream.finish()[0] == 3 and (tmp_path / "f").read_bytes() == b"abc"


def test_a_filesystem_refusing_direct_writes_gets_buffered_ones_and_loses_nothing(direct_dir, small_bounce,
                                                                                   monkeypatch):
    refused = refuse_direct_io(monkeypatch, "pwrite")
    stream = hashing_file(direct_dir / "f")
    expected = b"".join(_pieces(1))
    for piece in _pieces(1):
        stream.write(piece)
    size, digest = stream.finish()
    assert refused, "the direct write was tried first"
    assert size == len(expected) and (direct_dir / "f").read_bytes() == expected
    plain = HashingFile(direct_dir / "g")
    plain.write(expected)
    assert digest == plain.finish()[1]


def _ranges(total: int, seed: int) -> list[tuple[int, int]]:
    """Adjacent ranges of mixed sizes covering [0, total), shuffled: tensors in a safetensors file."""
    rng = random.Random(seed)
    ranges, start = [], 0
    while start < total:
        n = min(total - start, rng.choice([1, 5, ALIGN - 3, ALIGN, 3 * ALIGN + 11, 9 * ALIGN + 1]))
        ranges.append((start, n))
        start += n
    rng.shuffle(ranges)
    return ranges


@pytest.mark.parametrize("refuse", [False, True])
def test_positional_writes_from_two_writers_land_exactly(direct_dir, small_bounce, monkeypatch, refuse):
    """Two writers (as two ranks) share one pre-sized file and write interleaved ranges whose edges
    share blocks; the file ends byte-identical to the source."""
    if refuse:
        refused = refuse_direct_io(monkeypatch, "pwrite")
    total = 40 * ALIGN + 123
    source = random.Random(7).randbytes(total)
    path = direct_dir / "model.safetensors"
    path.write_bytes(b"\0" * total)
    fds = [os.open(path, os.O_RDWR) for _ in range(2)]
    writers = [PositionalWriter(path, fd) for fd in fds]
    for i, (start, n) in enumerate(_ranges(total, seed=3)):
        writers[i % 2].write(memoryview(source)[start:start + n], start)
    for writer, fd in zip(writers, fds, strict=True):
        writer.close()
        os.fsync(fd)
        os.close(fd)
    assert path.read_bytes() == source
    if refuse:
        assert refused

