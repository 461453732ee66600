"""The keys a model's weights are saved under: global tensor names, layout- and layer-spec-free.

torch_dist keys are global tensor names, so one checkpoint loads into any TP/PP/EP layout. They
also depend on the layer spec: with Transformer Engine, norms feeding a linear layer are fused
into it (`linear_qkv.layer_norm_weight`), while the local (CPU) spec keeps separate norm modules.
Megatron-Core maps most local names onto the TE ones, but not all (MoE layers' pre-MLP norm;
MLA's q/kv latent norms; MLA dense layers' pre-MLP norm). `model_state` renames those keys to
the names the Transformer Engine spec uses, so a checkpoint written on CPU loads into a GPU model
and back. Conversion (`mcore_io`) and training (`training/checkpoint/`) both save and load
model weights under `model_state`'s keys: that is what makes a converted checkpoint and a
training checkpoint the same thing. This module is all training needs of `checkpointing/`.
"""

from __future__ import annotations

from typing import Any

import torch

# TE name of each separately-built norm, by (layer context). Values are key fragments before
# "weight"/"bias"; the local spec may already have renamed some (listed as known aliases).
_QKV_FUSED = "self_attention.linear_qkv.layer_norm_"
_FC1_FUSED = "mlp.linear_fc1.layer_norm_"
_Q_UP_FUSED = "self_attention.linear_q_up_proj.layer_norm_"
_KV_UP_FUSED = "self_attention.linear_kv_up_proj.layer_norm_"
_KNOWN_FRAGMENTS = ("input_layernorm.", "pre_mlp_layernorm.", "self_attention.q_layernorm.",
                    "self_attention.kv_layernorm.", _QKV_FUSED, _FC1_FUSED, _Q_UP_FUSED, _KV_UP_FUSED)


def _is_norm(module: Any) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return module is not None and not isinstance(module, IdentityOp) and any(True for _ in module.parameters())


def _te_fragments(layer: Any) -> dict[str, str]:
    """local module path (within the layer) -> the TE key fragment it must be saved under."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    out = {}
    attention = layer.self_attention
    if isinstance(attention, SelfAttention) and _is_norm(layer.input_layernorm):
        out["input_layernorm."] = _QKV_FUSED
    if _is_norm(getattr(layer, "pre_mlp_layernorm", None)):
        out["pre_mlp_layernorm."] = "pre_mlp_layernorm." if isinstance(layer.mlp, MoELayer) else _FC1_FUSED
    if isinstance(attention, MLASelfAttention):
        if _is_norm(getattr(attention, "q_layernorm", None)):
            out["self_attention.q_layernorm."] = _Q_UP_FUSED
        if _is_norm(getattr(attention, "kv_layernorm", None)):
            out["self_attention.kv_layernorm."] = _KV_UP_FUSED
    return out


def _retarget(key: str, param: str, target: str) -> str:
    for fragment in _KNOWN_FRAGMENTS:
        if key.endswith(fragment + param):
            return key[: -len(fragment + param)] + target + param
    raise AssertionError(f"unexpected norm key {key!r}")


def canonical_sharded_state_dict(chunk: torch.nn.Module) -> dict[str, Any]:
    """The sharded state of `chunk` (DDP / Float16Module wrappers looked through: their keys are
    prefixed) with norm keys named as under the Transformer Engine spec."""
    model = unwrap(chunk)
    state = model.sharded_state_dict()
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return state
    for index, layer in enumerate(decoder.layers):
        for local, target in _te_fragments(layer).items():
            for param in ("weight", "bias"):
                entry = state.get(f"decoder.layers.{index}.{local}{param}")
                if entry is not None:
                    entry.key = _retarget(entry.key, param, target)
    return state


def model_state(chunks: list[torch.nn.Module]) -> dict[str, dict[str, Any]]:
    """The sharded state of a role's model chunks, in Megatron's `model` / `model<i>` convention."""
    if len(chunks) == 1:
        return {"model": canonical_sharded_state_dict(chunks[0])}
    return {f"model{i}": canonical_sharded_state_dict(chunk) for i, chunk in enumerate(chunks)}


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk
