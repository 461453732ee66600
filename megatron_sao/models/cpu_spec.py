"""Megatron-Core layer specs that build every supported family without Transformer Engine (CPU).

megatron-bridge's `local_layer_spec` builds one uniform MoE layer with standard attention for
every layer. That is right for Qwen3-MoE but wrong for the other families the recipes use:
GLM-4.5 and DeepSeek-V3 start with dense layers (`moe_layer_freq`), DeepSeek-V3 and GLM-5 use
multi-latent attention (MLA), GLM-5 adds the DSA indexer. `cpu_block_spec` is
Megatron-Core's own per-layer block spec (`get_gpt_decoder_block_spec`) with the local backend,
which the family bridges would use with Transformer Engine off, plus the two pieces Megatron-Core
0.19.2 lacks for that path:

- the core attention: the local `DotProductAttention` materialises `[s, s]` scores, refuses
  context parallelism, and accepts no `k_channels` / `v_channels` (MLA's query/key and value heads
  differ in size). `cpu_attention.CausalAttention` replaces it in every standard and MLA layer:
  causal by position (no mask tensor), flash-style (memory linear in s), context parallel.
- the DSA indexer asks its backend for a plain (TP-duplicated) `linear()`, which the local
  backend does not provide. `DuplicatedLinear` is that layer on torch. GLM-5's sparse core
  attention (`DSAttention`) is Megatron-Core's own; under CP it all-gathers keys and values
  itself (`cp_comm_type="allgather"`, the only one it accepts).

`models.build` uses `cpu_block_spec` whenever CUDA is absent (training and conversion alike); on
GPU the bridges' own (Transformer Engine) specs apply.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_sao.models.cpu_attention import CausalAttention


class DuplicatedLinear(torch.nn.Module):
    """A linear layer replicated on every tensor-parallel rank (Transformer Engine's
    `parallel_mode="duplicated"`), with Megatron's linear calling convention: returns
    (output, bias or None)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Any,
                 bias: bool = False, skip_bias_add: bool = False, skip_weight_param_allocation: bool = False,
                 parallel_mode: str | None = "duplicated", **_: Any) -> None:
        super().__init__()
        if parallel_mode not in (None, "duplicated"):
            raise NotImplementedError(f"DuplicatedLinear cannot be {parallel_mode}-parallel")
        if skip_weight_param_allocation:
            raise NotImplementedError("DuplicatedLinear always owns its weight")
        self.skip_bias_add = skip_bias_add
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
        if config.perform_initialization:
            init_method(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {}, sharded_offsets)


def _local_backend_with_linear() -> Any:
    from megatron.core.models.backends import LocalSpecProvider

    class LocalSpecProviderWithLinear(LocalSpecProvider):
        def linear(self) -> type:
            return DuplicatedLinear

    return LocalSpecProviderWithLinear()


def _use_causal_core_attention(layer_specs: list[Any]) -> None:
    for spec in layer_specs:
        attention = spec.submodules.self_attention
        submodules = getattr(attention, "submodules", None)
        if submodules is not None and getattr(submodules, "core_attention", None) is DotProductAttention:
            submodules.core_attention = CausalAttention


def _use_column_parallel_down_projections(layer_specs: list[Any]) -> None:
    """Absorbed MLA (DSA) accepts its q/kv down projections as TE's duplicated `TELinear` or as a
    `ColumnParallelLinear`, which is what the local MLA spec uses; the indexer keeps `DuplicatedLinear`."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    for spec in layer_specs:
        submodules = getattr(spec.submodules.self_attention, "submodules", None)
        for name in ("linear_q_down_proj", "linear_kv_down_proj"):
            if getattr(submodules, name, None) is DuplicatedLinear:
                setattr(submodules, name, ColumnParallelLinear)


def cpu_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """The decoder block spec of `config` (this pipeline stage) built from local modules."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if getattr(config, "experimental_attention_variant", None) is None:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                           normalization=config.normalization, vp_stage=vp_stage)
        _use_causal_core_attention(block.layer_specs)
        return block

    from megatron.core.models.gpt import experimental_attention_variant_module_specs as variants
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    backend = _local_backend_with_linear()
    layer_specs = variants.get_transformer_layer_with_experimental_attention_variant_spec(config, backend=backend)
    _use_column_parallel_down_projections(layer_specs)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local = layer_specs[offset: offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    norm = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=norm)
