"""Raw reads of torch_dist tensor items (fastio/distcp_items.py, fastio/distcp_reader.ParallelFileReader):
the bytes found are the tensor's, and only items a raw read can fill are read raw; everything else
loads through torch.load with the same result."""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch.distributed import checkpoint
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter

from megatron_sao.checkpointing.fastio.distcp_items import storage_range
from megatron_sao.checkpointing.fastio.distcp_reader import ParallelFileReader


@pytest.mark.parametrize(("tensor", "raw"), [
    (torch.randn(3, 5), True),
    (torch.arange(10, dtype=torch.bfloat16), True),
    (torch.randn(2, 3, 4), True),
    (torch.tensor(3.0), True),
    (torch.zeros(0, 4), True),
    (torch.randn(4, 4)[1:3], False),  # a view: torch.save writes its whole storage
    (torch.randn(3, 5).t(), False),  # transposed strides: the bytes are not in the target's order
], ids=["2d", "bf16", "3d", "scalar", "empty", "view", "transposed"])
def test_storage_range_finds_exactly_the_tensors_bytes(tmp_path, tensor: torch.Tensor, raw: bool):
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    blob = buffer.getvalue()
    path = tmp_path / "item"
    path.write_bytes(b"x" * 123 + blob + b"y" * 7)  # an item inside a larger .distcp file
    fd = os.open(path, os.O_RDONLY)
    try:
        start = storage_range(fd, 123, len(blob), tensor.dtype, tuple(tensor.shape))
        assert (start is not None) == raw
        assert storage_range(fd, 123, len(blob), torch.float16, tuple(tensor.shape)) is None  # another dtype
        assert storage_range(fd, 123, len(blob), tensor.dtype, (*tensor.shape, 1)) is None  # another shape
        assert storage_range(fd, 122, len(blob), tensor.dtype, tuple(tensor.shape)) is None  # not an item's start
        if start is not None:
            nbytes = tensor.numel() * tensor.element_size()
            assert os.pread(fd, nbytes, start) == tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    finally:
        os.close(fd)


def test_the_reader_reads_whole_chunks_raw_and_the_rest_through_torch_load(tmp_path):
    generator = torch.Generator().manual_seed(0)
    saved = {
        "w": torch.randn(64, 32, generator=generator),
        "b": torch.randn(32, generator=generator).to(torch.bfloat16),
        "t": torch.randn(8, 16, generator=generator).t(),  # saved with transposed strides
        "cast": torch.randn(16, generator=generator).to(torch.bfloat16),
        "step": torch.tensor(7),
    }
    checkpoint.save(saved, storage_writer=FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    targets = {n: torch.full(t.shape, -1, dtype=t.dtype) for n, t in saved.items()}
    targets["cast"] = torch.zeros(16, dtype=torch.float32)  # loaded into another dtype: cast by torch
    targets["w"] = torch.zeros(32, 64).t()  # a non-contiguous target: raw read, then copied in
    reader = ParallelFileReader(tmp_path, thread_count=2)
    checkpoint.load(targets, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    for name, tensor in saved.items():
        assert torch.equal(targets[name], tensor.to(targets[name].dtype)), name
    assert reader.raw_items == 3  # w, b, step; t (strides) and cast (dtype) through torch.load
