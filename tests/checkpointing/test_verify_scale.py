"""`sao convert verify` without the whole HF model on a rank: multi-rank agrees with one rank.

A 4-layer Qwen3-MoE checkpoint is converted on 2 gloo ranks and verified there (Megatron in DP 2
and in PP 2); then verified again on 1 rank. The streamed HF forward must equal transformers'
whole-model forward bit for bit, on 1 rank and on 2; on 2 ranks each rank must have loaded only
its block of decoder layers (rank 0 also the embedding, rank 1 the norm and LM head), and no rank
may keep any weight materialised afterwards.
"""

from __future__ import annotations

import pytest
import torch

from megatron_sao.checkpointing.model_setup import Layout
from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint
from megatron_sao.platform import run_distributed
from tests.checkpointing._verify_jobs import verify_job


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("verify_scale")
    hf = build_tiny_hf_checkpoint(root / "qwen3_moe_4l", family="qwen3_moe", dtype=torch.float32,
                                  num_hidden_layers=4)
    # GLM-5 (DSA): its decoder layers return (hidden, indexer top-k), both broadcast to the other rank.
    dsa = build_tiny_hf_checkpoint(root / "glm_moe_dsa", family="glm_moe_dsa", dtype=torch.float32)
    mcore = root / "mcore"
    two = run_distributed(verify_job, 2, hf, mcore, Layout(tp=2), [Layout(), Layout(pp=2)], (dsa,),
                          timeout_s=600)
    one = run_distributed(verify_job, 1, hf, mcore, None, [Layout()], timeout_s=600)
    return {"two": two, "one": one}


@pytest.mark.slow
def test_multi_rank_verify_agrees_with_one_rank(runs):
    one = runs["one"][0]["verify"][Layout().describe()]
    for rank_result in runs["two"]:
        for layout, (max_abs, mean_abs) in rank_result["verify"].items():
            assert max_abs <= 1e-5, layout
            assert max_abs == pytest.approx(one[0], abs=1e-6) and mean_abs == pytest.approx(one[1], abs=1e-7), layout
    assert runs["two"][0]["verify"][Layout().describe()] == one  # same computation on both sides


@pytest.mark.slow
def test_streamed_forward_equals_the_whole_model(runs):
    whole = runs["two"][0]["whole"]
    for result in (*runs["two"], *runs["one"]):
        assert torch.equal(result["streamed"], whole)
    assert torch.equal(runs["one"][0]["whole"], whole)
    dsa_whole = runs["two"][0]["others"]["glm_moe_dsa"][1]
    for result in runs["two"]:
        assert torch.equal(result["others"]["glm_moe_dsa"][0], dsa_whole)


@pytest.mark.slow
def test_each_rank_loads_only_its_block_and_frees_it(runs):
    assert runs["two"][0]["loaded_units"] == ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    assert runs["two"][1]["loaded_units"] == ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]
    assert runs["one"][0]["loaded_units"] == ["model.embed_tokens", *[f"model.layers.{i}" for i in range(4)],
                                              "model.norm", "lm_head"]
    assert all(r["still_materialised"] == [] for r in (*runs["two"], *runs["one"]))
