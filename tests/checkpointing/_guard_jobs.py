"""A spawned job for the export-guard tests: convert a tiny checkpoint, then export it with a
doctored manifest table (one tensor dropped from it, one added, one with a wrong shape)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def export_with_doctored_manifests(hf_dir: Path, work: Path) -> dict[str, str]:
    from megatron_sao.checkpointing.hf_to_mcore import HfToMcoreRequest, convert_hf_to_mcore
    from megatron_sao.checkpointing.mcore_to_hf import McoreToHfRequest, convert_mcore_to_hf

    mcore = work / "mcore"
    convert_hf_to_mcore(HfToMcoreRequest(hf_dir=hf_dir, out_dir=mcore, progress=False))
    table_of = {
        "extra": lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"},
        "missing": lambda t: {**t, "model.layers.0.mlp.gate.extra_weight": {"dtype": "F32", "shape": [4]}},
        "shape": lambda t: {**t, "model.norm.weight": {**t["model.norm.weight"],
                                                      "shape": [t["model.norm.weight"]["shape"][0] + 1]}},
    }
    errors = {}
    for case, change in table_of.items():
        doctored = work / f"mcore_{case}"
        shutil.copytree(mcore, doctored)
        manifest = json.loads((doctored / "sao_manifest.json").read_text())
        manifest["hf_tensors"] = change(manifest["hf_tensors"])
        (doctored / "sao_manifest.json").write_text(json.dumps(manifest))
        try:
            convert_mcore_to_hf(McoreToHfRequest(mcore_dir=doctored, out_dir=work / f"hf_{case}", progress=False))
            errors[case] = ""
        except ValueError as e:
            errors[case] = str(e)
        errors[f"{case}/out_exists"] = str((work / f"hf_{case}").exists())
    return errors
