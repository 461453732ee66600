"""Weight payloads for the engines' update endpoints, both sides of the wire.

Three ways in, as SGLang has them (docs: "SGLang for RL Systems", "Open-To-Use Refit"):

- from disk: an HF checkpoint directory; nothing to encode.
- from tensor: `/update_weights_from_tensor` takes `serialized_named_tensors`, one string per
  engine TP rank. For SGLang the bucket is one flattened tensor (`load_format="flattened_bucket"`,
  sglang's `weight_sync/tensor_bucket.FlattenedTensorBucket`, as slime sends it): one CUDA IPC
  handle per bucket instead of one per tensor, readable only by processes on the same node
  (`encode_sglang_flattened_payload`, needs sglang). The CPU engine cannot read IPC handles; it
  takes `load_format="safetensors"` (a project extension): each string is the base64 of a
  safetensors file of HF-named tensors (`encode_safetensors_payload`). Unlike a pickle, it cannot
  execute code when decoded.
- from distributed: a process group between the trainer (rank 0, the broadcast source) and the
  engine ranks; `/update_weights_from_distributed` announces names / dtypes / shapes, then the
  trainer broadcasts each tensor in that order. The trainer opens its end with
  `init_update_group` (registered in torch's c10d registry under the group's name, as SGLang's
  own `init_custom_process_group` registers the engines' ends: a second open under the same
  name fails until `destroy_update_group`); the CPU engine's end is `create_weight_update_group`.

Tensor names are HuggingFace checkpoint names (what megatron-bridge exports, e.g.
`model.layers.0.mlp.experts.3.up_proj.weight`), not the fused in-memory names of transformers.
"""

from __future__ import annotations

import base64
import datetime
from collections.abc import Iterable, Mapping, Sequence

import torch

SAFETENSORS_LOAD_FORMAT = "safetensors"
DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name


def _as_dict(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    out: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if name in out:
            raise ValueError(f"tensor {name!r} appears twice in one weight payload")
        out[name] = tensor
    return out


def encode_safetensors_payload(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> str:
    """base64(safetensors bytes) of `named_tensors`, for the CPU engine's
    `/update_weights_from_tensor` with `load_format="safetensors"`."""
    from safetensors.torch import save

    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in _as_dict(named_tensors).items()}
    return base64.b64encode(save(tensors)).decode("ascii")


def decode_safetensors_payload(payload: str | bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        raw = base64.b64decode(payload, validate=True)
        return load(raw)
    except Exception as e:  # binascii.Error, SafetensorError: both mean a malformed payload
        raise ValueError(f"not a base64 safetensors payload: {e}") from e


SGLANG_FLATTENED_LOAD_FORMAT = "flattened_bucket"  # sglang 0.5.23 model_runner weight_updater


def encode_sglang_flattened_payload(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], tp_size: int
) -> tuple[list[str], torch.Tensor]:
    """SGLang's `serialized_named_tensors` for `load_format="flattened_bucket"`: the bucket
    concatenated into one uint8 tensor plus its metadata, serialised once and repeated for every
    engine TP rank (each rank deserialises its own copy and copies what it holds to its GPU).
    Returns the strings and the flattened tensor, which must stay alive until every engine has
    answered (the strings carry a CUDA IPC handle of it).

    Before serialising, sglang's `monkey_patch_torch_reductions` makes the handle name the GPU by
    UUID instead of by index (`srt/utils/patch_torch.py`; sglang's own sender
    `srt/weight_sync/utils.py` does the same), so a trainer and an engine that see the GPUs under
    different `CUDA_VISIBLE_DEVICES` still agree on the device. GPU only."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError as e:
        raise ImportError(
            "encode_sglang_flattened_payload needs the 'sglang' package (GPU only; requirements-gpu.txt pins "
            "sglang==0.5.23). On CPU use encode_safetensors_payload with the CPU engine."
        ) from e
    monkey_patch_torch_reductions()
    bucket = FlattenedTensorBucket(named_tensors=[(n, t.detach().contiguous()) for n, t in
                                                  _as_dict(named_tensors).items()])
    flat = bucket.get_flattened_tensor()
    payload = MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": bucket.get_metadata()},
                                                  output_str=True)
    return [payload] * tp_size, flat


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype string SGLang's `update_weights_from_distributed` expects ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def parse_dtype_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def create_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 300.0,
):  # -> torch.distributed.ProcessGroup
    """The CPU engine's end of a weight update group: a bare gloo group outside torch's registry
    (an engine is its own process in production; in tests it shares the trainer's process, whose
    registry holds the trainer's end under the same name). Rank 0 hosts the TCP store and is the
    broadcast source. Blocks until all `world_size` ranks have joined."""
    import torch.distributed as dist

    if backend != "gloo":
        raise NotImplementedError(
            f"create_weight_update_group supports backend='gloo' only (got {backend!r}); NCCL weight "
            "broadcast to SGLang engines is set up by SGLang's /init_weights_update_group on the engine side"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout)
    # The store keys of a group made by `_new_process_group_helper` over `PrefixStore(group_name,
    # store)` (sglang's init_custom_process_group on an engine, `init_update_group` on the
    # trainer): "<group_name>/" then "<device>/" (torch distributed_c10d.py), so both ends meet.
    keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    return dist.ProcessGroupGloo(keys, rank, world_size, timeout)


def init_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 300.0,
):  # -> torch.distributed.ProcessGroup
    """The trainer's end of the weight update group (rank 0, the broadcast source), gloo or NCCL,
    registered in torch's c10d registry under `group_name` the way sglang's
    `init_custom_process_group` (`srt/utils/common.py`) registers the engines' ends:
    `_new_process_group_helper` over a `PrefixStore(group_name, store)`. Opening the same name
    again fails (torch: "The specified group name has already been created") until
    `destroy_update_group`. Rank 0 hosts the TCP store itself: torch's `tcp://` rendezvous would
    make every rank a store client under torchrun (`TORCHELASTIC_USE_AGENT_STORE`,
    `torch/distributed/rendezvous.py` `_create_c10d_store`), leaving nobody to host it."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), dist.PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_update_group(group) -> None:
    """Destroy a group from `init_update_group` (its name can be opened again afterwards; slime's
    `disconnect_rollout_engines_from_distributed` does the same)."""
    import torch.distributed as dist

    dist.destroy_process_group(group)


def broadcast_tensors(group, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Broadcast `tensors` in order over `group` (source side sends, others receive in place)."""
    for tensor in tensors:
        group.broadcast(tensor, src).wait()
