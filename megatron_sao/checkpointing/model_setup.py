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

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

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

    def describe(self) -> str:
        etp = self.etp if self.etp is not None else self.tp
        return f"tp={self.tp} pp={self.pp} ep={self.ep} etp={etp}"

    def as_dict(self, world_size: int) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "etp": self.etp if self.etp is not None else self.tp,
                "world_size": world_size}


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


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk
