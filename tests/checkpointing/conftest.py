"""Session fixtures: tiny checkpoints of every family, converted on 2 gloo ranks: what the default
run checks in one job (`conversions`), the rest of the family x layout matrix in a second one
(`more_conversions`) that only `slow` tests ask for. Both jobs convert on the standard path first,
then some of the same cases again on the fast-I/O path (`--fastio`, results under
`case_key(family, fastio=True)`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_sao.checkpointing.model_setup import Layout
from megatron_sao.platform import run_distributed
from tests.checkpointing._helpers import tiny_checkpoint
from tests.checkpointing._jobs import FamilyCase, layout_name, run_families

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


# What the default run converts. Every family's critic chain (TP2 import, PP2 export, EP2 import,
# TP1 export). Qwen3-MoE (the main family): TP1 -> PP2 and TP2 -> EP2 and the training-load checks: imports in
# TP1, TP2 and EP2 and exports in TP1, PP2 and EP2 (test_layouts.py imports in PP2 x VPP2). Every
# other family: TP2 -> EP2 (the manifest test reads each family's TP2 import) and verify;
# DeepSeek-V3 also TP1 -> PP2 (its MTP tensor and Transformer Engine names are read from the TP1
# import). The family x layout pairs left out: `more_conversions` (slow).
DEFAULT_RUN_LAYOUTS = {
    "qwen3_moe": ROUND_TRIP_LAYOUTS[:2],
    "glm4_moe": ROUND_TRIP_LAYOUTS[1:2],
    "deepseek_v3": ROUND_TRIP_LAYOUTS[:2],
    "glm_moe_dsa": ROUND_TRIP_LAYOUTS[1:2],
}
# Issue 14 asks for the critic round trip of every family in the default suite.
DEFAULT_RUN_CRITICS = set(DEFAULT_FAMILIES)
# The fast-I/O path (off by default) in the default run: Qwen3-MoE's round trips of
# DEFAULT_RUN_LAYOUTS. The slow job runs every other family's DEFAULT_RUN_LAYOUTS and every critic
# chain on it too.
DEFAULT_RUN_FASTIO = {"qwen3_moe"}


def case_key(family: str, fastio: bool = False) -> str:
    return f"{family}@fastio" if fastio else family


def fastio_layouts(family: str) -> list[str]:
    """The import layouts each family round-trips on the fast-I/O path."""
    return [layout_name(imp) for imp, _ in DEFAULT_RUN_LAYOUTS[family]]


def conversion_param(family: str, layout: str | None = None, fastio: bool = False):
    """pytest.param(family[, layout], fastio, job): the session fixture that converts it, `conversions`
    (default run) or `more_conversions` (marked slow). Without a layout: the family's critic chain."""
    if fastio:
        fast = layout is not None and family in DEFAULT_RUN_FASTIO
    elif layout is None:
        fast = family in DEFAULT_RUN_CRITICS
    else:
        fast = layout in {layout_name(imp) for imp, _ in DEFAULT_RUN_LAYOUTS[family]}
    values = (family,) if layout is None else (family, layout)
    return pytest.param(*values, fastio, "conversions" if fast else "more_conversions",
                        marks=() if fast else pytest.mark.slow,
                        id="-".join([*values, "fastio" if fastio else "standard"]))


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_hf")


@pytest.fixture(scope="session")
def family_checkpoints(tiny_root: Path) -> dict[str, Path]:
    return {f: tiny_checkpoint(tiny_root, f, dtype, mtp) for f, (dtype, mtp) in DEFAULT_FAMILIES.items()}


@pytest.fixture(scope="session")
def conversions(family_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The default run's conversions (DEFAULT_RUN_LAYOUTS, every family's critic chain, the
    training-load checks on Qwen3-MoE), 2 ranks; then DEFAULT_RUN_FASTIO's round trips on the
    fast-I/O path."""
    work = tmp_path_factory.mktemp("conversions")
    cases = [
        FamilyCase(name=family, hf_dir=path, work=work / family, layouts=DEFAULT_RUN_LAYOUTS[family],
                   verify_layouts=[Layout(), Layout(tp=2)] if family == "qwen3_moe" else [Layout()],
                   critic=family in DEFAULT_RUN_CRITICS, training_load=family == "qwen3_moe")
        for family, path in family_checkpoints.items()
    ]
    cases += [FamilyCase(name=case_key(family, fastio=True), hf_dir=family_checkpoints[family],
                         work=work / case_key(family, fastio=True), layouts=DEFAULT_RUN_LAYOUTS[family],
                         verify_layouts=[], fastio=True)
              for family in sorted(DEFAULT_RUN_FASTIO)]
    results = run_distributed(run_families, 2, cases, timeout_s=900)[0]
    return {"results": results, "cases": {c.name: c for c in cases}}


@pytest.fixture(scope="session")
def more_conversions(family_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Slow: every family through the round-trip pairs the default run leaves out, 2 ranks; then
    on the fast-I/O path every family's critic chain and the DEFAULT_RUN_LAYOUTS pairs of the
    families the default run does not convert that way."""
    work = tmp_path_factory.mktemp("more_conversions")
    cases = [
        FamilyCase(name=family, hf_dir=path, work=work / family, verify_layouts=[],
                   layouts=[pair for pair in ROUND_TRIP_LAYOUTS if pair not in DEFAULT_RUN_LAYOUTS[family]],
                   critic=family not in DEFAULT_RUN_CRITICS)
        for family, path in family_checkpoints.items()
    ]
    cases += [FamilyCase(name=case_key(family, fastio=True), hf_dir=path, work=work / case_key(family, fastio=True),
                         layouts=[] if family in DEFAULT_RUN_FASTIO else DEFAULT_RUN_LAYOUTS[family],
                         verify_layouts=[], critic=True, fastio=True)
              for family, path in family_checkpoints.items()]
    results = run_distributed(run_families, 2, cases, timeout_s=1800)[0]
    return {"results": results, "cases": {c.name: c for c in cases}}
