"""distcp_stream: one pass over a file hashes every byte and fills every item exactly, past the page
cache or through it."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_sao.checkpointing.digest import digest_file
from megatron_sao.checkpointing.fastio.direct_io import ALIGN
from megatron_sao.checkpointing.fastio.distcp_stream import StreamItem, stream_file
from tests.checkpointing._helpers import refuse_direct_io


def _file(tmp_path, nbytes: int) -> tuple[str, torch.Tensor]:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data.numpy().tobytes())
    return str(path), data


def _items(spans: list[tuple[int, int]], dtype: torch.dtype, log: list[str]) -> list[StreamItem]:
    items = []
    for i, (start, nbytes) in enumerate(spans):
        target = torch.full((nbytes // dtype.itemsize,), 7, dtype=dtype)
        items.append(StreamItem(name=f"item{i}", start=start, target=target,
                                done=lambda i=i: log.append(f"done item{i}")))
    return items


@pytest.mark.parametrize("how", ["direct", "refused", "buffered"])
def test_one_pass_fills_every_item_and_hashes_the_whole_file(tmp_path, monkeypatch, how):
    """Items at unaligned offsets, spanning several chunks, touching the file's first and last
    bytes, listed out of order; a filesystem refusing direct reads (at open or at read time) gets
    the same bytes through the page cache."""
    size = 5 * 2 * ALIGN + 123  # five chunks of 2 blocks and a partial one
    path, data = _file(tmp_path, size)
    refused = refuse_direct_io(monkeypatch) if how == "refused" else []
    if how == "buffered":  # a filesystem refusing O_DIRECT at open
        from megatron_sao.checkpointing.fastio import distcp_stream

        monkeypatch.setattr(distcp_stream, "open_direct", lambda *args, **kwargs: None)
    log: list[str] = []
    spans = [(3 * ALIGN + 10, 2 * ALIGN), (0, 6), (7, 4 * ALIGN + 2), (size - 12, 12), (2 * ALIGN, 0)]
    items = _items(spans, torch.bfloat16, log)
    admit = lambda nbytes: log.append(f"admit {nbytes}")  # noqa: E731
    digest = stream_file(path, items, "xxh3_128", admit=admit, chunk_bytes=2 * ALIGN)
    assert digest == digest_file(tmp_path / "__0_0.distcp", "xxh3_128")
    for item, (start, nbytes) in zip(items, spans, strict=True):
        assert torch.equal(item.target.view(torch.uint8), data[start:start + nbytes]), item.name
    assert sorted(line for line in log if line.startswith("done")) == [f"done item{i}" for i in range(5)]
    for i, (_, nbytes) in enumerate(spans):  # each item admitted (its bytes) before it is done
        assert log.index(f"done item{i}") > log.index(f"admit {nbytes}")
    assert bool(refused) == (how == "refused")


def test_an_item_past_the_end_of_the_file_names_it(tmp_path):
    path, _ = _file(tmp_path, 3 * ALIGN)
    log: list[str] = []
    items = _items([(0, 16), (3 * ALIGN - 8, 16)], torch.float32, log)
    with pytest.raises(OSError, match=r"ends inside tensor item 'item1': truncated file"):
        stream_file(path, items, "xxh3_128", chunk_bytes=2 * ALIGN)
    assert log == ["done item0"]


def test_an_empty_file_hashes_like_one(tmp_path):
    path = tmp_path / "empty.distcp"
    path.write_bytes(b"")
    assert stream_file(str(path), [], "sha256") == digest_file(path, "sha256")
    assert os.path.getsize(path) == 0


def test_buffers_are_no_bigger_than_a_small_file(tmp_path, monkeypatch):
    """A file smaller than the chunk (metadata, tokenizer) gets buffers of its own size, rounded up
    to the block, and still the same bytes."""
    from megatron_sao.checkpointing.fastio import distcp_stream

    sizes: list[int] = []
    real = distcp_stream.Bounce

    def recording(nbytes: int | None = None) -> object:
        sizes.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(distcp_stream, "Bounce", recording)
    path, data = _file(tmp_path, ALIGN + 5)
    log: list[str] = []
    items = _items([(1, ALIGN + 2)], torch.uint8, log)
    assert stream_file(path, items, "xxh3_128") == digest_file(path, "xxh3_128")
    assert torch.equal(items[0].target, data[1:ALIGN + 3])
    assert sizes == [2 * ALIGN, 2 * ALIGN]
