"""megatron-sao: Single-rollout Asynchronous Optimization (SAO) on Megatron-Core."""

__version__ = "0.1.0"
