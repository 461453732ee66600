"""Session fixtures: tiny checkpoints of every family, converted once on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_sao.checkpointing.model_setup import Layout
from megatron_sao.platform import run_distributed
from tests.checkpointing._helpers import tiny_checkpoint
from tests.checkpointing._jobs import FamilyCase, run_families

# (import layout, export layout): every import layout is exported through a different one, so
# each round trip also reshards the torch_dist checkpoint on load.
ROUND_TRIP_LAYOUTS = [
    (Layout(), Layout(pp=2)),
    (Layout(tp=2), Layout(ep=2)),
    (Layout(ep=2), Layout(tp=2)),
    (Layout(pp=2), Layout()),
]
# family -> (dtype of the tiny checkpoint in the default run, carry an MTP-layer tensor)
DEFAULT_FAMILIES = {
    "qwen3_moe": (torch.float32, False),
    "glm4_moe": (torch.bfloat16, False),
    "deepseek_v3": (torch.float32, True),
    "glm_moe_dsa": (torch.bfloat16, False),
}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_hf")


@pytest.fixture(scope="session")
def family_checkpoints(tiny_root: Path) -> dict[str, Path]:
    return {f: tiny_checkpoint(tiny_root, f, dtype, mtp) for f, (dtype, mtp) in DEFAULT_FAMILIES.items()}


@pytest.fixture(scope="session")
def conversions(family_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every family through every layout and the critic chain (+ training-load checks on Qwen3-MoE), 2 ranks."""
    work = tmp_path_factory.mktemp("conversions")
    cases = [
        FamilyCase(name=family, hf_dir=path, work=work / family, layouts=ROUND_TRIP_LAYOUTS,
                   verify_layouts=[Layout(), Layout(tp=2)] if family == "qwen3_moe" else [Layout()],
                   critic=True, training_load=family == "qwen3_moe")
        for family, path in family_checkpoints.items()
    ]
    results = run_distributed(run_families, 2, cases, timeout_s=900)[0]
    return {"results": results, "cases": {c.name: c for c in cases}}
