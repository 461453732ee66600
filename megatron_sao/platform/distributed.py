"""torch.distributed and Megatron-Core parallel state, from the config.

One code path for clusters and laptops: NCCL when CUDA is present, gloo (plus the CPU shims)
otherwise; the rank's compute device is chosen here, once (`platform.device`). Processes are
started by torchrun / srun / `platform.spawn` / Ray (`platform.ray_ranks`) and find each other
through the usual env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT);
a bare single process needs none of them.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_sao.config.schema import ParallelismConfig
from megatron_sao.platform.cpu_shims import apply_cpu_shims
from megatron_sao.platform.device import select_compute_device

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 600.0, assigned_gpu_ids: Sequence[str] = ()) -> tuple[int, int]:
    """Initialise the default process group once; returns (rank, world_size).

    `assigned_gpu_ids`: the GPUs a launcher assigned this rank by id (a Ray rank actor passes
    `ray.get_gpu_ids()`); the compute device follows `platform.device`'s rule."""
    if not torch.cuda.is_available():
        apply_cpu_shims()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:  # a bare single process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = select_compute_device(assigned_gpu_ids)  # before NCCL: its communicators bind the current device
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    logger.info("torch.distributed: backend=%s rank=%d world=%d device=%s", backend, dist.get_rank(),
                dist.get_world_size(), device)
    return dist.get_rank(), dist.get_world_size()


def init_model_parallel(parallelism: ParallelismConfig, seed: int = 1234) -> None:
    """(Re)initialise Megatron parallel state (TP, PP, VPP, CP, EP, ETP; DP is what remains) and RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    init_distributed()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallelism.tensor,
        pipeline_model_parallel_size=parallelism.pipeline,
        virtual_pipeline_model_parallel_size=parallelism.virtual_pipeline,
        context_parallel_size=parallelism.context,
        expert_model_parallel_size=parallelism.expert,
        expert_tensor_parallel_size=(
            parallelism.expert_tensor if parallelism.expert_tensor is not None else parallelism.tensor
        ),
    )
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tp_random.model_parallel_cuda_manual_seed(seed)
    else:
        # The CUDA RNG tracker reads CUDA RNG state. On CPU, weights are initialised on the full
        # tensor and split (use_cpu_initialization), so ranks agree without per-rank streams, and
        # the models here use no dropout; the inference tracker's fork() is a no-op.
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
