"""Conversion on the emulated compute device (tests/emulated_device.py): hf-to-mcore, verify and
mcore-to-hf on 2 ranks, every collective input and model input checked against the compute
device, as on a GPU node (where conversion builds its model on CUDA and the group is NCCL)."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.checkpointing.model_setup import Layout
from megatron_sao.platform import run_distributed
from tests.checkpointing._helpers import differences


def _convert_on_emulated_device(hf_dir: Path, work: Path, layout: Layout, verify_layout: Layout) -> dict[str, Any]:
    from tests.checkpointing._jobs import _hf_to_mcore, _mcore_to_hf, _verify
    from tests.emulated_device import emulated_compute_device

    out: dict[str, Any] = {}
    with emulated_compute_device() as world:
        for key, fn, args in (("import", _hf_to_mcore, (hf_dir, work / "mcore", layout)),
                              ("verify", _verify, (hf_dir, work / "mcore", verify_layout)),
                              ("export", _mcore_to_hf, (work / "mcore", work / "hf", layout))):
            try:
                out[key] = fn(*args)
            except Exception:
                out[key] = {"error": traceback.format_exc()}
                break
        out["collectives"] = world.collectives
    return out


@pytest.mark.slow  # three conversions on 2 ranks: ~35 CPU-s
@pytest.mark.timeout(900)
def test_conversion_keeps_collective_and_model_inputs_on_the_compute_device(tiny_hf_dir, tmp_path):
    r = run_distributed(_convert_on_emulated_device, 2, tiny_hf_dir, tmp_path, Layout(ep=2), Layout(pp=2),
                        timeout_s=900)[0]
    for key in ("import", "verify", "export"):
        assert "error" not in r.get(key, {"error": "not run"}), r[key]["error"] if key in r else r
    assert r["verify"]["max_abs"] < 1e-4 and r["collectives"] > 0
    assert differences(tiny_hf_dir, tmp_path / "hf") == []
