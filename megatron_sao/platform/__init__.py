"""torch.distributed + Megatron parallel state, CPU shims, and local multi-process spawning."""

from megatron_sao.platform.cpu_shims import applied_cpu_shims, apply_cpu_shims
from megatron_sao.platform.distributed import (
    destroy_distributed,
    free_port,
    init_distributed,
    init_model_parallel,
)
from megatron_sao.platform.spawn import RankFailed, run_distributed

__all__ = [
    "RankFailed",
    "applied_cpu_shims",
    "apply_cpu_shims",
    "destroy_distributed",
    "free_port",
    "init_distributed",
    "init_model_parallel",
    "run_distributed",
]
