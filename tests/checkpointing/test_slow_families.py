"""Slow (`-m slow`, ~2-3 min): every family in its other dtype, critics of every family, TP2 with ETP1.

The default run covers each family in one dtype (test_roundtrip) and the critic on Qwen3-MoE;
this repeats the round trip with the dtypes swapped, adds a TP2/ETP1 layout (experts not
tensor-parallel), and runs the critic chain (actor -> critic -> HF critic -> critic -> HF critic)
for every family.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_sao.checkpointing.model_setup import Layout
from megatron_sao.models import critic_format as cf
from megatron_sao.platform import run_distributed
from tests.checkpointing._helpers import differences, ok, tiny_checkpoint
from tests.checkpointing._jobs import FamilyCase, layout_name, run_families
from tests.checkpointing.conftest import DEFAULT_FAMILIES, ROUND_TRIP_LAYOUTS

pytestmark = pytest.mark.slow
OTHER_DTYPE = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float32}
LAYOUTS = [*ROUND_TRIP_LAYOUTS, (Layout(tp=2, etp=1), Layout(tp=2, etp=1))]


@pytest.fixture(scope="module")
def swapped(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("slow")
    cases = [
        FamilyCase(name=family, hf_dir=tiny_checkpoint(root, family, OTHER_DTYPE[dtype], mtp), work=root / family,
                   layouts=LAYOUTS, critic=True)
        for family, (dtype, mtp) in DEFAULT_FAMILIES.items()
    ]
    return {"results": run_distributed(run_families, 2, cases, timeout_s=1800)[0], "cases": {c.name: c for c in cases}}


@pytest.mark.parametrize("layout", [layout_name(imp) for imp, _ in LAYOUTS])
@pytest.mark.parametrize("family", list(DEFAULT_FAMILIES))
def test_other_dtype_round_trip_is_bit_identical(swapped, family, layout):
    case = swapped["cases"][family]
    ok(swapped["results"][family][f"import/{layout}"])
    ok(swapped["results"][family][f"export/{layout}"])
    assert differences(case.hf_dir, case.work / f"hf_{layout}") == []


@pytest.mark.parametrize("family", list(DEFAULT_FAMILIES))
def test_other_dtype_logits_agree(swapped, family):
    assert ok(swapped["results"][family]["verify/tp1pp1ep1"])["max_abs"] <= 1e-5


@pytest.mark.parametrize("family", list(DEFAULT_FAMILIES))
def test_every_family_critic_round_trips(swapped, family):
    results, work = swapped["results"][family], Path(swapped["cases"][family].work)
    for step in ("critic/from_actor", "critic/export_a", "critic/reimport", "critic/export_b"):
        ok(results[step])
    assert differences(work / "critic_hf_a", work / "critic_hf_b") == []
    assert differences(swapped["cases"][family].hf_dir, work / "critic_hf_a",
                       ignore=frozenset({cf.LM_HEAD, cf.VALUE_WEIGHT, cf.VALUE_BIAS})) == []
    assert ok(results["critic/verify"])["max_abs"] <= 1e-5
