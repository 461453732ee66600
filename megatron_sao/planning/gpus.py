"""The GPUs `sao plan` knows: usable memory and dense bf16 throughput.

Memory is what `nvidia-smi` reports as total for the part (not the marketing number); throughput
is the dense (no 2:4 sparsity) bf16 tensor-core peak of the SXM part from NVIDIA's data sheets.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    """The `--gpu` name: <model>-<marketed memory>."""
    memory_gib: float
    """Total device memory as the driver reports it, GiB."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("h100-80g", memory_gib=81559 / 1024, bf16_tflops=989.0),
        GpuSpec("h200-141g", memory_gib=143771 / 1024, bf16_tflops=989.0),
        GpuSpec("b200-180g", memory_gib=183359 / 1024, bf16_tflops=2250.0),
    )
}


def gpu_spec(name: str) -> GpuSpec:
    """The spec of `name`, or ValueError listing the known ones."""
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None
