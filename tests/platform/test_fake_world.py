"""`platform/fake_world.py`: one process as rank r of a large world, Megatron's parallel state
for that world, and tensors without memory; everything it changes is restored on exit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_sao.platform.fake_world import fake_tensors, fake_world, meta_tensors


def test_megatron_parallel_state_of_a_512_rank_world_in_one_process() -> None:
    from megatron.core import parallel_state as ps

    with fake_world(512, rank=300):
        ps.initialize_model_parallel(tensor_model_parallel_size=8, pipeline_model_parallel_size=2,
                                     context_parallel_size=4, expert_model_parallel_size=256,
                                     expert_tensor_parallel_size=1)
        assert (dist.get_rank(), dist.get_world_size()) == (300, 512)
        assert ps.get_tensor_model_parallel_world_size() == 8
        assert ps.get_context_parallel_world_size() == 4
        assert ps.get_data_parallel_world_size() == 512 // (8 * 2 * 4)
        assert ps.get_expert_model_parallel_world_size() == 256
        assert ps.get_expert_data_parallel_world_size() == 1
        assert ps.get_pipeline_model_parallel_rank() == 300 // 256  # PP is the outermost dimension
        # Megatron's gloo groups exist too (on the fake backend: no peers needed).
        assert dist.get_world_size(ps.get_data_parallel_group_gloo()) == 512 // (8 * 2 * 4)
        gathered: list = [None] * 4
        dist.all_gather_object(gathered, {"key": 1})  # every rank's object is this rank's
        assert gathered == [{"key": 1}] * 4
    assert not dist.is_initialized()
    assert not ps.is_initialized()
    assert dist.all_gather_object.__module__ == "torch.distributed.distributed_c10d"


def test_a_fake_world_refuses_a_process_with_torch_distributed_already_up() -> None:
    with fake_world(2), pytest.raises(RuntimeError, match=r"without torch\.distributed initialised"), fake_world(2):
        pass
    assert not dist.is_initialized()


def test_meta_tensors_allocate_nothing_and_restore_what_they_change() -> None:
    current_device, tensor_type = torch.cuda.current_device, torch.Tensor.type
    with meta_tensors():
        huge = torch.empty(10**12)  # 4 TB
        assert huge.device.type == "meta"
        assert torch.cuda.current_device() == "meta"
        assert huge.type() == "torch.FloatTensor"
    assert (torch.cuda.current_device, torch.Tensor.type) == (current_device, tensor_type)
    assert torch.empty(2).device.type == "cpu"


def test_fake_tensors_keep_their_device_and_raise_on_a_mismatch() -> None:
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    with fake_tensors():
        weight = torch.empty(10**6, 1024, device="cuda")  # no CUDA here, no memory either
        index = torch.zeros(4, dtype=torch.long)
        assert weight.device.type == "cuda"
        with pytest.raises(FakeTensorDeviceMismatchError):
            torch.nn.functional.embedding(index, weight)
