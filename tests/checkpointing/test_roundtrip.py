"""HF -> mcore -> HF is bit-identical for every family and layout; Megatron computes what HF does.

Each family's tiny checkpoint is converted on 2 gloo ranks into TP1 (DP2), TP2, EP2 and PP2
layouts and exported back through another layout (conftest.ROUND_TRIP_LAYOUTS), so every round
trip also reshards; the default run converts each family through the pairs in
conftest.DEFAULT_RUN_LAYOUTS, the other pairs are slow. "Bit-identical" is checked on raw bytes of
every tensor, with names, shapes and dtypes (GLM checkpoints are bf16 with fp32 router biases;
DeepSeek-V3 carries an extra MTP-layer tensor through). Round trips run on the standard path and on
the fast-I/O path (`--fastio`, off by default): Qwen3-MoE's both ways in the default run, every
other family's fast-I/O round trips slow.
"""

from __future__ import annotations

import json

import pytest

from megatron_sao.models.hf_files import TORCH_TO_ST
from tests.checkpointing._helpers import all_tensors, differences, ok
from tests.checkpointing._jobs import layout_name
from tests.checkpointing.conftest import (
    DEFAULT_FAMILIES,
    ROUND_TRIP_LAYOUTS,
    case_key,
    conversion_param,
    fastio_layouts,
)

FAMILIES = list(DEFAULT_FAMILIES)
LAYOUTS = [layout_name(imp) for imp, _ in ROUND_TRIP_LAYOUTS]
ROUND_TRIPS = ([conversion_param(f, lay) for f in FAMILIES for lay in LAYOUTS]
               + [conversion_param(f, lay, fastio=True) for f in FAMILIES for lay in fastio_layouts(f)])


@pytest.mark.parametrize(("family", "layout", "fastio", "job"), ROUND_TRIPS)
def test_hf_to_mcore_to_hf_is_bit_identical(request, family, layout, fastio, job):
    conversions = request.getfixturevalue(job)
    results = conversions["results"][case_key(family, fastio)]
    case = conversions["cases"][case_key(family, fastio)]
    assert ok(results[f"import/{layout}"])["fastio"] == fastio
    export = ok(results[f"export/{layout}"])
    assert export["fastio"] == fastio
    assert export["load_overlapped"], "the export ran after the load, not beside it"
    assert export["checksum_files"] > 0, "this rank verified none of the checkpoint's files"
    if fastio:
        assert export["released_bytes"] > 0, "no parameter was given back once exported"
        assert export["checksummed_while_loading"] == export["checksum_files"], "a file was read twice to be hashed"
    else:
        assert export["released_bytes"] == 0 and export["checksummed_while_loading"] == 0
    assert differences(case.hf_dir, case.work / f"hf_{layout}") == []


@pytest.mark.parametrize("job", ["conversions", pytest.param("more_conversions", marks=pytest.mark.slow)])
def test_the_standard_path_never_imports_fastio(request, job):
    """Every standard-path case of the job ran before its first fast-I/O case, in the same processes:
    none of them imported `checkpointing.fastio` (where all O_DIRECT, page release and raw item
    reads live), so the switch really is off by default; the fast-I/O cases did import it."""
    results = request.getfixturevalue(job)["results"]
    standard = {name: r["fastio_loaded"] for name, r in results.items() if not name.endswith("@fastio")}
    assert standard and not any(standard.values()), standard
    assert all(r["fastio_loaded"] for name, r in results.items() if name.endswith("@fastio"))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_and_megatron_logits_agree_in_fp32(conversions, family):
    """Tolerance 1e-5 max-abs (float32 on CPU; observed ~2e-7)."""
    case = conversions["cases"][family]
    for layout in case.verify_layouts:
        result = ok(conversions["results"][family][f"verify/{layout_name(layout)}"])
        assert result["max_abs"] <= 1e-5, (layout, result)


@pytest.mark.parametrize("family", FAMILIES)
def test_manifest_lists_every_tensor_and_file(conversions, family):
    case = conversions["cases"][family]
    mcore = case.work / "mcore_tp2pp1ep1"
    manifest = json.loads((mcore / "sao_manifest.json").read_text())
    source = {n: {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape)} for n, t in all_tensors(case.hf_dir).items()}
    assert manifest["hf_tensors"] == source
    assert manifest["role"] == "actor" and manifest["layout"]["tp"] == 2
    stored = {str(p.relative_to(mcore)) for p in mcore.rglob("*") if p.is_file()} - {"sao_manifest.json"}
    assert set(manifest["files"]) == stored
    assert len(manifest["checksum"]) == 64
    assert (mcore / "hf" / "config.json").read_bytes() == (case.hf_dir / "config.json").read_bytes()
    assert all(not p.name.endswith(".safetensors") for p in (mcore / "hf").iterdir())


def test_mtp_layer_tensor_is_carried_through(conversions):
    case = conversions["cases"]["deepseek_v3"]
    manifest = json.loads((case.work / "mcore_tp1pp1ep1" / "sao_manifest.json").read_text())
    assert manifest["passthrough"] == ["model.layers.61.eh_proj.weight"]
    assert ok(conversions["results"]["deepseek_v3"]["import/tp1pp1ep1"])["passthrough"] == manifest["passthrough"]


@pytest.mark.parametrize("family, expected, absent", [
    # Transformer Engine names for norms the local (CPU) spec builds as separate modules.
    ("qwen3_moe", ["decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                   "decoder.layers.pre_mlp_layernorm.weight"], ["input_layernorm", "linear_fc1.layer_norm"]),
    ("deepseek_v3", ["decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.1.pre_mlp_layernorm.weight",
                     "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
                     "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight",
                     "decoder.layers.0.input_layernorm.weight"], ["q_layernorm", "kv_layernorm"]),
])
def test_checkpoint_keys_are_transformer_engine_names(conversions, family, expected, absent):
    manifest = json.loads((conversions["cases"][family].work / "mcore_tp1pp1ep1" / "sao_manifest.json").read_text())
    keys = set(manifest["mcore_tensors"])
    assert set(expected) <= keys
    assert not [k for k in keys for a in absent if a in k]
