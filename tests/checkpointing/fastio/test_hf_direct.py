"""`PrefetchingSource(fastio=True)` (`fastio.hf_direct`): HF tensors read past the page cache into
pooled buffers are exact, whether the filesystem takes O_DIRECT or refuses it at read time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_sao.checkpointing.hf_reader import PrefetchingSource
from megatron_sao.models.hf_files import HFCheckpoint
from tests.checkpointing._helpers import refuse_direct_io, small_hf_checkpoint
from tests.checkpointing._helpers import safetensors_reference as _reference

KB = 1024


@pytest.fixture
def checkpoint(tmp_path: Path) -> HFCheckpoint:
    return small_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("refuse", [False, True])
def test_tensors_read_past_the_page_cache_or_through_it_are_exact(checkpoint, monkeypatch, refuse):
    """Direct reads take the whole blocks around each tensor (offsets here are not block-aligned);
    a filesystem refusing them at read time gets buffered reads for the rest of the file."""
    from megatron_sao.checkpointing.fastio.direct_io import open_direct

    probe = open_direct(checkpoint.path / "model.safetensors", os.O_RDONLY)
    if probe is None:
        pytest.skip("the filesystem refuses O_DIRECT")
    os.close(probe)
    refused = refuse_direct_io(monkeypatch) if refuse else []
    reference = _reference(checkpoint)
    source = PrefetchingSource(checkpoint, bucket_bytes=KB, fastio=True)
    try:
        got = {name: source.load_tensors([name])[name] for name in reference}
        direct_fd = source.fast.direct_fd("model.safetensors")
    finally:
        source.close()
    for name, tensor in reference.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert (direct_fd is None) == refuse
    assert len(refused) == (1 if refuse else 0)  # refused once, then the page cache for this file


@pytest.mark.parametrize("refuse", [False, True])
def test_a_consumed_tensors_buffer_serves_a_later_read_and_every_tensor_stays_exact(checkpoint, monkeypatch, refuse):
    """Tensors of one size read one after the other, each dropped after use: later reads reuse the
    buffers (past the page cache or through it); a tensor still held keeps its bytes."""
    if refuse:
        refuse_direct_io(monkeypatch)
    reference = _reference(checkpoint)
    source = PrefetchingSource(checkpoint, bucket_bytes=64 * KB, fastio=True)  # buffers are whole pages at least
    try:
        kept = source.load_tensors(["layer.0.w"])["layer.0.w"]
        for i in range(1, 8):
            name = f"layer.{i}.w"
            tensor = source.load_tensors([name])[name]
            assert torch.equal(tensor, reference[name]), name
            del tensor
        assert source.fast.buffers.reused >= 5
        assert torch.equal(kept, reference["layer.0.w"])
    finally:
        source.close()
