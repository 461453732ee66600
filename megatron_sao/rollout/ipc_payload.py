"""CUDA-IPC weight payloads for the CPU engine: `load_format="torch_ipc"` (a project extension).

SGLang's own tensor payload is a pickle of CUDA IPC handles (`MultiprocessingSerializer`), which
needs sglang to decode and executes code when it does; the CPU engine's other payload
(`safetensors`) copies the bytes through the request. This one carries handles, like SGLang's,
but as JSON data: per HF-named tensor, its dtype, shape, stride and storage offset plus the
arguments `torch.multiprocessing.reductions.rebuild_cuda_tensor` takes, as torch's
`reduce_tensor` produces them (the same handles torch's multiprocessing and SGLang send). The
receiver maps the sender's GPU memory (`cudaIpcOpenMemHandle`) and copies from it; decoding runs
no code from the payload. Same node and same visible devices only (the handle names the device by
its index). A CPU-engine process on a CUDA machine reads these (tools/gpu_check.sh, check c).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch

TORCH_IPC_LOAD_FORMAT = "torch_ipc"
_REBUILD_ARGS = 15  # torch.multiprocessing.reductions.reduce_tensor's CUDA tuple (torch 2.6 - 2.13)
_FIELDS = {"name": str, "dtype": str, "size": list, "stride": list, "offset": int, "device": int, "handle": str,
           "storage_bytes": int, "storage_offset_bytes": int, "ref_counter_handle": str, "ref_counter_offset": int,
           "event_handle": (str, type(None)), "event_sync_required": bool}


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode("ascii")


def encode_torch_ipc_payload(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> tuple[str, list[torch.Tensor]]:
    """(payload, tensors to keep alive): the payload points into the tensors' GPU memory, so the
    caller holds them until the engine has answered. CUDA tensors only."""
    from torch.multiprocessing.reductions import reduce_tensor

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    entries, keep = [], []
    for name, tensor in items:
        if tensor.device.type != "cuda":
            raise ValueError(f"{name}: a torch_ipc payload carries CUDA tensors, got one on {tensor.device}")
        tensor = tensor.detach().contiguous()
        keep.append(tensor)
        _, args = reduce_tensor(tensor)
        if len(args) != _REBUILD_ARGS:
            raise RuntimeError(f"torch {torch.__version__}: reduce_tensor gave {len(args)} arguments, not "
                               f"{_REBUILD_ARGS}; update megatron_sao/rollout/ipc_payload.py")
        (_, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset_bytes, _,
         ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
        entries.append({"name": name, "dtype": str(dtype).removeprefix("torch."), "size": list(size),
                        "stride": list(stride), "offset": int(offset), "device": int(device),
                        "handle": _b64(handle), "storage_bytes": int(storage_bytes),
                        "storage_offset_bytes": int(storage_offset_bytes),
                        "ref_counter_handle": _b64(ref_counter_handle), "ref_counter_offset": int(ref_counter_offset),
                        "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync_required)})
    return json.dumps(entries), keep


def _entries(payload: str | bytes) -> list[dict[str, Any]]:
    try:
        entries = json.loads(payload)
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a torch_ipc payload (JSON expected): {e}") from e
    if not isinstance(entries, list):
        raise ValueError("not a torch_ipc payload: a JSON list of tensors expected")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"torch_ipc payload entry {i} is not an object")
        for key, kind in _FIELDS.items():
            if not isinstance(entry.get(key), kind) or (kind is int and isinstance(entry.get(key), bool)):
                raise ValueError(f"torch_ipc payload entry {i} ({entry.get('name')!r}): field {key!r} missing or "
                                 f"not {getattr(kind, '__name__', kind)}")
        dtype = getattr(torch, entry["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"torch_ipc payload entry {i} ({entry['name']!r}): unknown dtype {entry['dtype']!r}")
    return entries


def decode_torch_ipc_payload(payload: str | bytes) -> dict[str, torch.Tensor]:
    """HF name -> CUDA tensor mapped from the sender's memory (valid while the sender keeps it).
    ValueError for a malformed payload or a process without CUDA."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    entries = _entries(payload)
    if not torch.cuda.is_available():
        raise ValueError("torch_ipc payloads carry CUDA IPC handles: this engine process has no CUDA device")
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        if e["name"] in out:
            raise ValueError(f"tensor {e['name']!r} appears twice in one weight payload")
        event = None if e["event_handle"] is None else base64.b64decode(e["event_handle"])
        out[e["name"]] = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(e["size"]), tuple(e["stride"]), e["offset"], torch.storage.TypedStorage,
            getattr(torch, e["dtype"]), e["device"], base64.b64decode(e["handle"]), e["storage_bytes"],
            e["storage_offset_bytes"], False, base64.b64decode(e["ref_counter_handle"]), e["ref_counter_offset"],
            event, e["event_sync_required"])
    return out
