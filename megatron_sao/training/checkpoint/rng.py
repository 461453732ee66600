"""Per-rank state a checkpoint records beside the tensors: the parallel layout and the RNG states.

RNG states (python, numpy, torch CPU, CUDA when present, and Megatron's model-parallel CUDA RNG
tracker) are stored one shard per global rank. They are restored only into the layout they were
saved from: in another layout rank r is a different piece of the model, and no mapping of old
streams onto new ranks would reproduce the old run anyway.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from megatron_sao.platform.collective import rank, world_size

RNG_KEY = "rng_state"


def current_layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "world": world_size(),
        "tensor": ps.get_tensor_model_parallel_world_size(),
        "pipeline": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "context": ps.get_context_parallel_world_size(),
        "expert": ps.get_expert_model_parallel_world_size(),
        "expert_tensor": ps.get_expert_tensor_parallel_world_size(),
        "data": ps.get_data_parallel_world_size(),
    }


def rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def rng_object(state: dict[str, Any] | None) -> Any:
    """Per-rank RNG states: one shard per global rank, loadable only into the same world size."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(RNG_KEY, state, (world_size(),), (rank(),), replica_id=0)
