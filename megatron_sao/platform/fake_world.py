"""One process standing in for one rank of a large world, without its GPUs, peers or memory.

`fake_world(world_size, rank)` initialises torch.distributed with torch's fake process-group
backend (`torch.testing._internal.distributed.fake_pg`: every collective completes at once and
moves nothing), so Megatron's parallel state for a world of hundreds of ranks is initialised in
one process, with this process as `rank`. Inside it, a model of any size builds without memory:
- `meta_tensors()`: every tensor on the meta device (shape and dtype, no storage, no kernel runs);
  the fastest way to build (a 30B-A3B rank's actor and critic with their optimizers: ~2 CPU-s);
- `fake_tensors()`: torch's `FakeTensorMode`: tensors keep the device they were made for, and
  mixing devices raises as on real hardware; ~6x slower to build with.

Two kinds of call need help in a fake world, and get it only inside `fake_world`:
- groups created with an explicit backend: Megatron asks for gloo groups beside its main ones
  (megatron-core 0.19.2 `parallel_state.create_group(..., backend="gloo")`), and a gloo group
  needs real peers; every group is created on the fake backend instead;
- object collectives: `get_megatron_optimizer` aligns parameter groups across ranks with
  `all_gather_object` (optimizer/__init__.py `_get_param_groups`), which pickles through the
  group and reads sizes back with `.item()`, impossible without data. Here every rank's object
  is this rank's: the assumption of a fake world is that the ranks of one layout build the same
  structure, which holds for everything Megatron builds from one config.
Nothing computed in a fake world is a number to trust: use it for shapes, counts and whether
code runs at all (`sao train --dry-run`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """torch.distributed on the fake backend as `rank` of `world_size` for the duration of the
    block; Megatron's parallel state (if initialised inside) and the process group are torn down
    on exit. Refused when torch.distributed is already initialised in this process."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without torch.distributed initialised")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    new_group, all_gather_object = dist.new_group, dist.all_gather_object

    def fake_new_group(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("backend", None)  # the default group's backend: fake
        kwargs.pop("pg_options", None)  # options of the backend asked for (NCCL's), not fake's
        return new_group(*args, **kwargs)

    def same_object_everywhere(object_list: list[Any], obj: Any, group: Any = None) -> None:
        object_list[:] = [copy.deepcopy(obj) for _ in object_list]

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    dist.new_group, dist.all_gather_object = fake_new_group, same_object_everywhere
    try:
        yield
    finally:
        dist.new_group, dist.all_gather_object = new_group, all_gather_object
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def fake_tensors() -> Any:
    """A `FakeTensorMode` context: tensors made inside have shapes, dtypes and devices but no
    storage (real tensors made before it may be mixed in, e.g. module buffers of a cached class)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def meta_tensors() -> Iterator[None]:
    """Tensors made inside live on the meta device. Besides torch's default device, two things
    Megatron reads are pointed at meta for the block:
    - `torch.cuda.current_device()`: Megatron makes its DDP parameter and gradient buffers there
      (megatron-core 0.19.2 `param_and_grad_buffer.py`); the CPU shim's "cpu" would allocate them;
    - `Tensor.type()`: the distributed optimizer takes only parameters whose type names a float
      tensor type (`distrib_optimizer.py` `_build_model_and_main_param_groups`, which the CPU shim
      also bridges); a meta tensor's "torch.meta.FloatTensor" is reported as "torch.FloatTensor"."""
    current_device, tensor_type = torch.cuda.current_device, torch.Tensor.type

    def type_without_meta(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = tensor_type(self, *args, **kwargs)
        return name.replace("torch.meta.", "torch.", 1) if isinstance(name, str) else name

    torch.cuda.current_device = lambda: "meta"  # type: ignore[assignment]
    torch.Tensor.type = type_without_meta  # type: ignore[method-assign]
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.cuda.current_device, torch.Tensor.type = current_device, tensor_type  # type: ignore[method-assign]
