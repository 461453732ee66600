"""Planning before queueing: parameter counts, a per-GPU memory model and a verdict (`sao plan`).

Works from a model's `config.json` alone (no weights): the parameter census comes from the causal
LM that transformers builds from that config on the meta device, so every architecture that
transformers and megatron-bridge know is counted the way they count it.
"""

from megatron_sao.planning.gpus import GPUS, GpuSpec, gpu_spec
from megatron_sao.planning.memory import MemoryPlan, plan_memory
from megatron_sao.planning.params import ModelCensus, census_from_hf_config, load_hf_config

__all__ = [
    "GPUS",
    "GpuSpec",
    "MemoryPlan",
    "ModelCensus",
    "census_from_hf_config",
    "gpu_spec",
    "load_hf_config",
    "plan_memory",
]
