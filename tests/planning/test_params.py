"""Parameter census: exact against transformers, hand formulas and the published model cards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_sao.planning.params import GROUPS, census_from_hf_config, param_group

MODELS = Path(__file__).resolve().parents[2] / "recipes" / "models"

# (model directory, card total, card active, which active count the vendor's card uses).
# Cards round; vendors differ on whether the embedding and LM head are "active": DeepSeek-V3's
# card says 36.6B active "including 0.9B for the output head" (no input embedding), GLM-4.5's 32B
# matches neither the embedding nor the head, Qwen counts both. See docs/planning.md.
CARDS = [
    ("qwen3_30b_a3b_thinking_2507", 30.5e9, 3.3e9, "params_active"),
    ("qwen3_235b_a22b_instruct_2507", 235e9, 22e9, "params_active"),
    ("glm45_355b_a32b", 355e9, 32e9, "params_active_without_embedding_and_head"),
    ("deepseek_v3_671b", 671e9, 37e9, "params_active_without_embedding"),
]


def _census(name: str):
    return census_from_hf_config(json.loads((MODELS / name / "config.json").read_text()))


@pytest.mark.parametrize(("name", "total", "active", "convention"), CARDS)
def test_counts_match_the_model_cards(name: str, total: float, active: float, convention: str) -> None:
    census = _census(name)
    assert census.params_total == pytest.approx(total, rel=0.015)
    # Qwen3-30B-A3B's "3.3B" is 3.353B truncated (1.6% off); its card has two significant digits.
    tolerance = 0.02 if name.startswith("qwen3_30b") else 0.015
    assert getattr(census, convention) == pytest.approx(active, rel=tolerance)


def test_qwen3_30b_a3b_by_hand() -> None:
    """Every Qwen3-MoE tensor written out: the census must agree to the parameter."""
    h, v, layers, heads, kv, hd, experts, topk, ffn = 2048, 151936, 48, 32, 4, 128, 128, 8, 768
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd
    per_layer = attention + experts * h + experts * 3 * h * ffn + 2 * h
    total = 2 * v * h + layers * per_layer + h
    census = _census("qwen3_30b_a3b_thinking_2507")
    assert census.params_total == total == 30_532_122_624
    assert census.params_active == total - layers * (experts - topk) * 3 * h * ffn
    assert census.critic_total == total - v * h + h  # LM head -> hidden x 1 value head
    assert census.params_mtp == 0


def test_deepseek_v3_mla_first_dense_layers_and_mtp() -> None:
    census = _census("deepseek_v3_671b")
    assert census.params_total == pytest.approx(671.0e9, rel=1e-3)
    assert [census.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert census.layers[0]["dense_mlp"] == 3 * 7168 * 18432
    assert census.kv_heads is None and census.kv_cache_elems_per_layer == 512 + 64
    # DeepSeek's card: the MTP module has 11.5B unique parameters.
    assert census.params_mtp == pytest.approx(11.5e9, rel=0.015)


def test_glm5_counts_the_sparse_attention_indexer() -> None:
    census = _census("glm5_744b_a40b")
    assert census.params_total == pytest.approx(744e9, rel=0.005)
    assert census.params_active == pytest.approx(40e9, rel=0.05)
    indexer = 2048 * 32 * 128 + 6144 * 128 + 2 * 128 + 6144 * 32
    mla = (6144 * 2048 + 2048 + 2048 * 64 * 256 + 6144 * 576 + 512 + 512 * 64 * (192 + 256) + 64 * 256 * 6144)
    assert census.layers[0]["attention"] == mla + indexer


def test_groups_cover_every_parameter_of_every_tiny_family() -> None:
    from megatron_sao.models.tiny_hf import supported_families, tiny_hf_config

    for family in supported_families():
        census = census_from_hf_config(tiny_hf_config(family).to_dict())
        assert set().union(*census.layers) <= set(GROUPS)
        assert census.group_total("experts") > 0 and census.group_total("attention") > 0


def test_param_group_names() -> None:
    assert param_group("model.layers.3.self_attn.q_norm.weight") == "attention"
    assert param_group("model.layers.3.input_layernorm.weight") == "norms"
    assert param_group("model.norm.weight") == "norms"
    assert param_group("model.layers.3.mlp.gate.weight") == "router"
    assert param_group("model.layers.3.mlp.shared_experts.up_proj.weight") == "shared_experts"
    assert param_group("model.layers.0.mlp.up_proj.weight") == "dense_mlp"
    assert param_group("lm_head.weight") == "head"
