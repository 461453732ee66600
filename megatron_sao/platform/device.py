"""The compute device of this rank: decided once, used by every tensor that feeds a model or a collective.

One rule, `init_distributed` applies it before the process group exists:
  - no CUDA: the CPU;
  - a launcher that assigned this rank GPUs by id (Ray: `ray.get_gpu_ids()` inside the rank's
    actor) -> the first assigned GPU, at its position among the GPUs this process sees
    (CUDA_VISIBLE_DEVICES; all of the node's when unset);
  - otherwise, exactly one visible GPU -> index 0: the launcher bound one GPU to this process
    (Ray's default, which sets each actor's CUDA_VISIBLE_DEVICES to its GPU; Slurm's
    `--gpus-per-task=1` / `--gpu-bind=single:1`);
  - otherwise the local rank (torchrun, `platform.spawn`, srun with the node's GPUs visible:
    LOCAL_RANK, which srun's adoption takes from SLURM_LOCALID), which must name a visible GPU.

Ray 2.60 (`ray/_private/utils.py:set_visible_accelerator_ids`, `accelerators/nvidia_gpu.py:
set_current_process_visible_accelerator_ids`) sets an actor's CUDA_VISIBLE_DEVICES to the ids of
the GPUs it was assigned, unless RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES is set; the node
index LOCAL_RANK is then not a valid device index for any rank but the first (it used to be
passed to `torch.cuda.set_device`).

Everything else reads `compute_device()`: micro-batches are moved there before the schedule
(training/batches.py), and metric sums, flags and broadcast buffers are created there, because
an NCCL process group has no CPU backend (torch c10d: a group initialised with backend "nccl"
registers a CUDA backend only) and a CUDA model cannot take CPU inputs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

_COMPUTE_DEVICE: torch.device | None = None


def visible_gpu_ids(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES (indices or UUIDs), None when it is unset (all visible)."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def cuda_index_for_rank(local_rank: int, device_count: int, assigned_gpu_ids: Sequence[str] = (),
                        visible_ids: Sequence[str] | None = None) -> int:
    """The index, among the CUDA devices this process sees, of the GPU this rank computes on
    (the rule in the module docstring). ValueError naming the variables when they cannot agree."""
    if device_count < 1:
        raise ValueError("no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES="
                         f"{','.join(visible_ids) if visible_ids is not None else 'unset'})")
    if assigned_gpu_ids:
        gpu = str(assigned_gpu_ids[0])
        if visible_ids is None:
            index = int(gpu)
        elif gpu in visible_ids:
            index = list(visible_ids).index(gpu)
        else:
            raise ValueError(f"the launcher assigned GPU {gpu} but CUDA_VISIBLE_DEVICES={','.join(visible_ids)} "
                             "does not list it")
        if index >= device_count:
            raise ValueError(f"the launcher assigned GPU {gpu} (device index {index}) but only {device_count} "
                             "CUDA devices are visible")
        return index
    if device_count == 1:
        return 0
    if not 0 <= local_rank < device_count:
        raise ValueError(f"LOCAL_RANK={local_rank} but this process sees {device_count} CUDA devices "
                         f"(CUDA_VISIBLE_DEVICES={','.join(visible_ids) if visible_ids is not None else 'unset'}): "
                         "give each rank one GPU or make the node's GPUs visible to every rank")
    return local_rank


def select_compute_device(assigned_gpu_ids: Sequence[str] = ()) -> torch.device:
    """Apply the rule to this process (environment, visible CUDA devices) and remember the result;
    on CUDA also make it the current device. Called once per rank by `init_distributed`."""
    global _COMPUTE_DEVICE
    if torch.cuda.is_available():
        index = cuda_index_for_rank(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count(),
                                    assigned_gpu_ids, visible_gpu_ids())
        torch.cuda.set_device(index)
        _COMPUTE_DEVICE = torch.device("cuda", index)
    else:
        _COMPUTE_DEVICE = torch.device("cpu")
    return _COMPUTE_DEVICE


def compute_device() -> torch.device:
    """This rank's compute device (`select_compute_device`'s choice; before it ran, the current
    CUDA device, or the CPU)."""
    if _COMPUTE_DEVICE is not None:
        return _COMPUTE_DEVICE
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
