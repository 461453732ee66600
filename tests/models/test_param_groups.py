from __future__ import annotations

import pytest
import torch

from megatron_sao.models.param_groups import apply_trainable, format_param_table, param_group, resolve_trainable

NAMES = {
    "embedding.word_embeddings.weight": "embedding",
    "decoder.layers.0.input_layernorm.weight": "norms",
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": "norms",  # TE-fused input norm
    "decoder.layers.0.self_attention.linear_qkv.weight": "attention",
    "decoder.layers.0.self_attention.linear_proj.weight": "attention",
    "decoder.layers.0.self_attention.q_layernorm.weight": "attention",
    "decoder.layers.0.self_attention.k_layernorm.weight": "attention",
    "decoder.layers.0.pre_mlp_layernorm.weight": "norms",
    "decoder.layers.0.mlp.router.weight": "router",
    "decoder.layers.0.mlp.router.expert_bias": "router",
    "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight": "experts",
    "decoder.layers.0.mlp.experts.linear_fc2.weight7": "experts",  # grouped-GEMM naming
    "decoder.layers.0.mlp.shared_experts.linear_fc1.weight": "shared_experts",
    "decoder.layers.1.mlp.linear_fc1.weight": "dense_mlp",
    "decoder.final_layernorm.weight": "norms",
    "output_layer.weight": "head",
    "module.module.decoder.layers.0.mlp.router.weight": "router",  # DDP / Float16Module prefixes
}


@pytest.mark.parametrize(("name", "group"), sorted(NAMES.items()))
def test_param_group(name, group):
    assert param_group(name) == group


def test_unknown_parameter_is_an_error():
    with pytest.raises(ValueError, match="matches no parameter group"):
        param_group("something.else.weight")


def test_frozen_wins_and_regex_selects():
    attn = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not resolve_trainable(attn, ["all"], ["attention"])
    assert resolve_trainable("decoder.layers.0.mlp.router.weight", ["all"], ["attention"])
    assert resolve_trainable(attn, ["re:layers\\.0\\."], [])
    assert not resolve_trainable("decoder.layers.1.self_attention.linear_qkv.weight", ["re:layers\\.0\\."], [])
    assert not resolve_trainable("output_layer.weight", ["experts", "router"], [])


def test_apply_trainable_counts_and_table():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
            layer = self.decoder.layers[0]
            layer.self_attention = torch.nn.Linear(4, 4, bias=False)
            layer.mlp = torch.nn.Module()
            layer.mlp.router = torch.nn.Linear(4, 2, bias=False)

    model = Tiny()
    counts = apply_trainable([model], ["all"], ["attention"])
    assert not model.decoder.layers[0].self_attention.weight.requires_grad
    assert model.decoder.layers[0].mlp.router.weight.requires_grad
    assert (counts["attention"].frozen, counts["router"].trainable) == (16, 8)
    table = format_param_table("critic", counts)
    assert "attention" in table and "total" in table and "experts" not in table
