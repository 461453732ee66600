"""Build the Megatron model a conversion fills or reads: the project's own actor/critic builder.

Conversion does not have a model builder of its own: it calls `models.build_model`, the one
training uses, so the converted checkpoint has exactly the module tree (and dist-checkpoint keys)
training builds. It only adds provider overrides that conversion needs:
- parameters in the checkpoint's dtype (bf16 stays bf16, also on CPU, where training computes in
  fp32 and upcasts on load),
- no random initialisation (every element is overwritten; see hf_to_mcore's completeness check).
On CPU `models.build` itself uses `models.cpu_spec.cpu_block_spec`, so dense-first, MLA and DSA
families build the same module tree here and in training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_sao.checkpointing.keys import unwrap

Role = Literal["actor", "critic"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Layout:
    """The parallel layout the model is built in for conversion (the checkpoint itself is
    layout-free: torch_dist reshards on load)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (model chunks per rank); None: one chunk."""
    cp: int = 1

    def describe(self) -> str:
        etp = self.etp if self.etp is not None else self.tp
        extra = (f" vpp={self.vpp}" if self.vpp is not None else "") + (f" cp={self.cp}" if self.cp != 1 else "")
        return f"tp={self.tp} pp={self.pp} ep={self.ep} etp={etp}{extra}"

    def as_dict(self, world_size: int) -> dict[str, int]:
        out = {"tp": self.tp, "pp": self.pp, "ep": self.ep, "etp": self.etp if self.etp is not None else self.tp,
               "world_size": world_size}
        if self.vpp is not None:
            out["vpp"] = self.vpp
        if self.cp != 1:
            out["cp"] = self.cp
        return out


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def conversion_config(hf_dir: Path, layout: Layout, world_size: int, dtype: torch.dtype, seed: int = 1234,
                      value_head_init_std: float = 0.02) -> Any:
    """The SaoConfig whose model is `hf_dir`'s architecture in `layout`, not loading HF weights."""
    from megatron_sao.config import load_config

    overrides = [
        f"model.hf_path={hf_dir}", "model.load_weights=false", "model.dtype=float32",
        f"parallelism.tensor={layout.tp}", f"parallelism.pipeline={layout.pp}", f"parallelism.expert={layout.ep}",
        f"parallelism.world_size={world_size}", f"run.seed={seed}",
        f"critic.value_head_init_std={value_head_init_std}", "logging.param_table=false",
    ]
    if layout.etp is not None:
        overrides.append(f"parallelism.expert_tensor={layout.etp}")
    if layout.vpp is not None:
        overrides.append(f"parallelism.virtual_pipeline={layout.vpp}")
    if layout.cp != 1:
        overrides.append(f"parallelism.context={layout.cp}")
    config = load_config(None, overrides)
    provider = config.model.provider_overrides
    provider["perform_initialization"] = False
    if dtype != torch.float32:
        provider.update(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
                        pipeline_dtype=dtype)
    return config


def build_for_conversion(config: Any, role: Role) -> list[torch.nn.Module]:
    """Initialise Megatron parallel state for `config` and build `role`'s model chunks on this rank."""
    from megatron_sao.models import build_model
    from megatron_sao.platform import init_model_parallel

    init_model_parallel(config.parallelism, seed=config.run.seed)
    return build_model(config, role=role).chunks


@contextlib.contextmanager
def one_op_thread() -> Iterator[None]:
    """Run torch ops on one intra-op thread while converting.

    A conversion's ops are memory-bound copies, fills and reductions; ATen's OpenMP workers spin
    between ops and take the cores the read-ahead, writer and hashing threads need. Measured on a
    2-core host (0.5 GB, hf-to-mcore load phase): 2.6-3.3 CPU-s with 2 intra-op threads, 1.3 with 1,
    in half the time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def shard_bytes(chunks: list[torch.nn.Module]) -> int:
    """Bytes of this rank's share of the model: its parameters and persistent buffers (what a
    rank must hold during a conversion; the memory budget is stated against it)."""
    total, seen = 0, set()
    for chunk in chunks:
        model = unwrap(chunk)
        persistent = set(model.state_dict(keep_vars=True))
        tensors = [p for _, p in model.named_parameters()]
        tensors += [b for n, b in model.named_buffers() if n in persistent]
        for tensor in tensors:
            if tensor.untyped_storage().data_ptr() not in seen:
                seen.add(tensor.untyped_storage().data_ptr())
                total += tensor.numel() * tensor.element_size()
    return total
