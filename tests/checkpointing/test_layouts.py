"""Round trips through virtual-pipeline (PP 2 x VPP 2) and context-parallel (CP 2) layouts.

A 4-layer Qwen3-MoE checkpoint (PP 2 x VPP 2 puts one layer in each of four model chunks) is
imported in one layout and exported through a different one, on 2 gloo ranks: VPP -> CP and
CP -> VPP, plus a VPP import exported through plain TP 2. Each export must be bit-identical to the
source; `verify` under CP 2 matches the HF logits. The torch_dist checkpoints also carry the layout
into the manifest.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_sao.checkpointing.model_setup import Layout
from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint
from megatron_sao.platform import run_distributed
from tests.checkpointing._helpers import differences, ok
from tests.checkpointing._jobs import FamilyCase, layout_name, run_families

VPP = Layout(pp=2, vpp=2)
CP = Layout(cp=2)
PAIRS = [(VPP, CP), (CP, VPP)]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("layouts")
    hf = build_tiny_hf_checkpoint(root / "qwen3_moe_4l", family="qwen3_moe", dtype=torch.float32,
                                  num_hidden_layers=4)
    case = FamilyCase(name="qwen3_moe", hf_dir=hf, work=root / "work", layouts=PAIRS, verify_layouts=[CP])
    return {"case": case, "results": run_distributed(run_families, 2, [case], timeout_s=600)[0]["qwen3_moe"]}


@pytest.mark.parametrize("imported, exported", PAIRS, ids=["vpp_to_cp", "cp_to_vpp"])
def test_round_trip_through_layout_is_bit_identical(layout_runs, imported, exported):
    case, results = layout_runs["case"], layout_runs["results"]
    name = layout_name(imported)
    ok(results[f"import/{name}"])
    ok(results[f"export/{name}"])
    assert differences(case.hf_dir, case.work / f"hf_{name}") == []


def test_verify_runs_under_context_parallelism(layout_runs):
    """Each CP rank computes its chunks of the prompt (the CPU attention implements CP); the
    gathered logits match the HF model's."""
    assert ok(layout_runs["results"][f"verify/{layout_name(CP)}"])["max_abs"] <= 1e-5


def test_manifest_records_the_vpp_and_cp_layouts(layout_runs):
    case = layout_runs["case"]
    for layout, key, value in ((VPP, "vpp", 2), (CP, "cp", 2)):
        manifest = json.loads((case.work / f"mcore_{layout_name(layout)}" / "sao_manifest.json").read_text())
        assert manifest["layout"][key] == value
        assert manifest["layout"]["world_size"] == 2
