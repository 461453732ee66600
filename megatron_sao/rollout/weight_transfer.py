"""Weight payloads for the engines' update endpoints, both sides of the wire.

Three ways in, as SGLang has them (docs: "SGLang for RL Systems", "Open-To-Use Refit"):

- from disk: an HF checkpoint directory; nothing to encode.
- from tensor: `/update_weights_from_tensor` takes `serialized_named_tensors`, one string per
  engine TP rank. SGLang's own format (`load_format=None`) is
  `MultiprocessingSerializer.serialize(named_tensors, output_str=True)`: pickled CUDA IPC
  handles, readable only by a process on the same GPUs (`encode_sglang_tensor_payload`, needs
  sglang). The CPU engine cannot read IPC handles; it takes `load_format="safetensors"` (a
  project extension): each string is the base64 of a safetensors file of HF-named tensors
  (`encode_safetensors_payload`). Unlike a pickle, it cannot execute code when decoded.
- from distributed: a process group between the trainer (rank 0, the broadcast source) and the
  engine ranks; `/update_weights_from_distributed` announces names / dtypes / shapes, then the
  trainer broadcasts each tensor in that order. `create_weight_update_group` builds the group
  on either side (gloo here: the CPU engine; SGLang on GPU builds its NCCL group itself).

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


def encode_sglang_tensor_payload(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], tp_size: int
) -> list[str]:
    """SGLang's native `serialized_named_tensors` (`load_format=None`): one
    `MultiprocessingSerializer` string per TP rank. GPU only: the tensors travel as CUDA IPC
    handles and must stay alive until the engine has copied them."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as e:
        raise ImportError(
            "encode_sglang_tensor_payload needs the 'sglang' package (GPU only; requirements-gpu.txt pins "
            "sglang==0.5.23). On CPU use encode_safetensors_payload with the CPU engine."
        ) from e
    items = list(_as_dict(named_tensors).items())
    return [MultiprocessingSerializer.serialize(items, output_str=True) for _ in range(tp_size)]


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
    """A stand-alone process group (outside `torch.distributed`'s default group, so a trainer can
    hold one next to its Megatron groups). Rank 0 hosts the TCP store and is the broadcast
    source. Blocks until all `world_size` ranks have joined."""
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
    return dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank, world_size, timeout)


def broadcast_tensors(group, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Broadcast `tensors` in order over `group` (source side sends, others receive in place)."""
    for tensor in tensors:
        group.broadcast(tensor, src).wait()
