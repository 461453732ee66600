"""Every refusal names the thing: file, tensor (with both shapes), architecture, directory, space.

Checks that need no model run in this process (`plan_*`); a failing and an interrupted conversion
run the real CLI in a subprocess.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_sao.checkpointing.digest import digest_file
from megatron_sao.checkpointing.hf_to_mcore import HfToMcoreRequest, plan_hf_to_mcore
from megatron_sao.checkpointing.manifest import check_files, read_manifest
from megatron_sao.checkpointing.mcore_to_hf import McoreToHfRequest, convert_mcore_to_hf, plan_mcore_to_hf
from megatron_sao.checkpointing.output_dir import TMP_MARKER, disk_full_as_value_error
from megatron_sao.models import critic_format as cf
from megatron_sao.models.hf_files import inspect_hf_checkpoint
from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint
from megatron_sao.platform import RankFailed, run_distributed
from tests.checkpointing._helpers import rewrite_tensors, split_into_shards

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("pristine") / "qwen3_moe", family="qwen3_moe")


@pytest.fixture
def hf(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint, free to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "hf"))


def plan(hf_dir: Path, out: Path, **kw):
    return plan_hf_to_mcore(HfToMcoreRequest(hf_dir=hf_dir, out_dir=out, **kw))


def edit_config(hf_dir: Path, **changes) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(config))


def test_missing_shard_file_is_named(hf, tmp_path):
    split_into_shards(hf, 2)
    (hf / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"missing checkpoint file model-00002-of-00002\.safetensors \(listed in "
                                         r"model\.safetensors\.index\.json for \d+ tensors"):
        plan(hf, tmp_path / "out")


def test_truncated_file_is_named(hf, tmp_path):
    path = hf / "model.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated safetensors file: its header promises \d+ "
                                         r"bytes, the file has \d+"):
        inspect_hf_checkpoint(hf)


def test_index_entry_absent_from_its_file_is_named(hf):
    split_into_shards(hf, 2)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"  # it is in shard 1
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors: partial checkpoint file: 1 tensors .* "
                                         r"'lm_head\.weight'"):
        inspect_hf_checkpoint(hf)


def test_missing_tensor_is_named(hf, tmp_path):
    rewrite_tensors(hf, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"})
    with pytest.raises(ValueError, match=r"missing or partial checkpoint files: 1 tensors that config\.json implies "
                                         r"are in no file: 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"):
        plan(hf, tmp_path / "out")


def test_config_weights_mismatch_names_tensor_and_both_shapes(hf, tmp_path):
    edit_config(hf, moe_intermediate_size=48)
    with pytest.raises(ValueError, match=r"config/weights mismatch for tensor 'model\.layers\.0\.mlp\.experts\.0\."
                                         r"down_proj\.weight': config\.json implies shape \[64, 48\], "
                                         r"model\.safetensors holds \[64, 32\]"):
        plan(hf, tmp_path / "out")


def test_tensor_outside_the_model_is_named(hf, tmp_path):
    rewrite_tensors(hf, lambda t: {**t, "model.layers.0.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"1 tensors in the files are not part of the model config\.json describes: "
                                         r"'model\.layers\.0\.mlp\.extra\.weight'"):
        plan(hf, tmp_path / "out")


def test_unsupported_architecture_lists_the_supported_ones(hf, tmp_path):
    edit_config(hf, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ValueError, match=r"unsupported architecture LlamaForCausalLM; supported: "
                                         r"DeepseekV3ForCausalLM, Glm4MoeForCausalLM, GlmMoeDsaForCausalLM, "
                                         r"Qwen3MoeForCausalLM"):
        plan(hf, tmp_path / "out")


def test_quantized_checkpoint_is_not_implemented(hf, tmp_path):
    edit_config(hf, quantization_config={"quant_method": "fp8"})
    with pytest.raises(NotImplementedError, match=r"quantized checkpoint \(fp8\).*issue 4"):
        plan(hf, tmp_path / "out")


def test_non_empty_output_is_refused_unless_overwrite(hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "something").write_text("x")
    with pytest.raises(ValueError, match=rf"output directory {out} exists and is not empty; pass --overwrite"):
        plan(hf, out)
    (out / "sao_manifest.json").write_text("{}")  # --overwrite replaces only a previous conversion output
    assert plan(hf, out, overwrite=True).role == "actor"


def test_output_that_is_a_file_is_refused(hf, tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        plan(hf, tmp_path / "out")


def test_too_little_disk_space_is_refused(hf, tmp_path, monkeypatch):
    monkeypatch.setattr("megatron_sao.checkpointing.output_dir.disk_free_bytes", lambda path: 1000)
    with pytest.raises(ValueError, match=rf"not enough disk space for {tmp_path / 'out'}: the conversion writes about "
                                         r"[\d.]+ MB, .* has 1.00 KB free"):
        plan(hf, tmp_path / "out")


def test_disk_full_while_writing_says_so(tmp_path):
    with pytest.raises(ValueError, match=rf"no disk space left while writing {tmp_path}"), \
            disk_full_as_value_error(tmp_path):
        raise OSError(errno.ENOSPC, "No space left on device")


def _make_critic(hf: Path, bias: float) -> None:
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(cf.critic_config(config)))

    def change(tensors):
        tensors.pop(cf.LM_HEAD)
        return {**tensors, cf.VALUE_WEIGHT: torch.randn(1, 64), cf.VALUE_BIAS: torch.tensor([bias])}

    rewrite_tensors(hf, change)


def test_critic_checkpoint_converts_as_critic_only(hf, tmp_path):
    _make_critic(hf, bias=0.0)
    assert plan(hf, tmp_path / "out").role == "critic"
    with pytest.raises(ValueError, match=r"is a critic checkpoint .* convert it with --role critic"):
        plan(hf, tmp_path / "out", role="actor")


def test_critic_with_a_value_bias_is_refused(hf, tmp_path):
    _make_critic(hf, bias=0.5)
    with pytest.raises(ValueError, match=r"score\.bias is non-zero \(\[0\.5\]\); megatron-sao's value head has no "
                                         "bias"):
        plan(hf, tmp_path / "out")


@pytest.fixture
def mcore(conversions, tmp_path: Path) -> Path:
    """A private copy of a converted Qwen3-MoE mcore checkpoint."""
    source = conversions["cases"]["qwen3_moe"].work / "mcore_tp1pp1ep1"
    return Path(shutil.copytree(source, tmp_path / "mcore"))


def export_plan(mcore_dir: Path, out: Path, **kw):
    return plan_mcore_to_hf(McoreToHfRequest(mcore_dir=mcore_dir, out_dir=out, **kw))


def test_mcore_without_manifest_is_refused(mcore, tmp_path):
    (mcore / "sao_manifest.json").unlink()
    with pytest.raises(ValueError, match=r"no sao_manifest\.json: not a megatron-sao mcore checkpoint, or an "
                                         r"incomplete one; pass --hf-config"):
        export_plan(mcore, tmp_path / "out")


def test_a_non_positive_export_bucket_is_refused(mcore, tmp_path):
    with pytest.raises(ValueError, match=r"--io-bucket-mb must be > 0 \(got 0 bytes\)"):
        export_plan(mcore, tmp_path / "out", io_bucket_bytes=0)


def test_missing_mcore_file_is_named(mcore, tmp_path):
    (mcore / "__0_0.distcp").unlink()
    with pytest.raises(ValueError, match=r"missing checkpoint file __0_0\.distcp \(listed in sao_manifest\.json\)"):
        export_plan(mcore, tmp_path / "out")


def test_missing_dist_metadata_is_named(mcore, tmp_path):
    (mcore / ".metadata").unlink()
    with pytest.raises(ValueError, match=r"missing checkpoint file \.metadata"):
        export_plan(mcore, tmp_path / "out")


def test_partial_mcore_file_is_named(mcore, tmp_path):
    path = mcore / "__0_0.distcp"
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"__0_0\.distcp: partial checkpoint file: \d+ bytes, the manifest records"):
        export_plan(mcore, tmp_path / "out")


def test_corrupt_mcore_file_fails_the_checksum(mcore, tmp_path):
    path = mcore / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    export_plan(mcore, tmp_path / "out")  # sizes at planning; checksums while the model loads
    request = McoreToHfRequest(mcore_dir=mcore, out_dir=tmp_path / "out", progress=False)
    with pytest.raises(RankFailed, match=r"__0_0\.distcp: checksum mismatch"):  # issue 14: a flipped bit was exported
        run_distributed(convert_mcore_to_hf, 1, request, timeout_s=600)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mcore"]  # nothing written, nothing left behind


def test_manifest_records_xxh3_digests_of_every_file(mcore):
    manifest = read_manifest(mcore)
    assert manifest.format == "sao-mcore-v2" and manifest.digest == "xxh3_128"
    assert set(manifest.files) == {str(p.relative_to(mcore)) for p in mcore.rglob("*")
                                   if p.is_file() and p.name != "sao_manifest.json"}
    for name, meta in manifest.files.items():  # the .distcp digests were computed while writing
        assert meta["xxh3_128"] == digest_file(mcore / name, "xxh3_128"), name
    check_files(mcore, manifest, verify_hashes=True)


def _as_v1_manifest(mcore_dir: Path) -> None:
    """Rewrite the manifest the way sao-mcore-v1 wrote it: SHA-256 entries, no `digest` field."""
    path = mcore_dir / "sao_manifest.json"
    data = json.loads(path.read_text())
    data.pop("digest")
    data["format"] = "sao-mcore-v1"
    data["files"] = {name: {"bytes": meta["bytes"],
                            "sha256": hashlib.sha256((mcore_dir / name).read_bytes()).hexdigest()}
                     for name, meta in data["files"].items()}
    path.write_text(json.dumps(data))


def test_v1_manifest_is_still_read_and_its_sha256_checked(mcore):
    _as_v1_manifest(mcore)
    manifest = read_manifest(mcore)
    assert manifest.digest == "sha256"
    check_files(mcore, manifest, verify_hashes=True)
    path = mcore / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"__0_0\.distcp: checksum mismatch"):
        check_files(mcore, manifest, verify_hashes=True)


def test_manifest_entry_without_its_digest_is_named(mcore):
    path = mcore / "sao_manifest.json"
    data = json.loads(path.read_text())
    del data["files"]["metadata.json"]["xxh3_128"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"corrupt manifest: the entry of 'metadata\.json' lacks its bytes or "
                                         r"xxh3_128 digest"):
        read_manifest(mcore)


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "tools" / "convert_hf_to_mcore.py"), *args, "--no-progress"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


@pytest.mark.slow
def test_failing_conversion_leaves_nothing_behind(hf, tmp_path):
    """A NaN in the source passes planning and fails the completeness check after the model is built."""
    rewrite_tensors(hf, lambda t: {**t, "model.norm.weight": torch.full_like(t["model.norm.weight"], float("nan"))})
    out = tmp_path / "out"
    proc = _cli("--hf", str(hf), "--out", str(out))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    assert "sao convert: error: Megatron tensor 'decoder.final_layernorm.weight' was not (completely) written" in stderr
    assert not out.exists() and list(tmp_path.glob(f".out{TMP_MARKER}*")) == []


def test_interrupted_conversion_never_looks_complete(hf, tmp_path):
    """SIGKILL as soon as the staging directory appears: --out keeps its old content, and the
    staging directory is hidden and refused as a checkpoint."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "previous").write_text("kept")
    (out / "sao_manifest.json").write_text("{}")  # a previous conversion output: --overwrite may replace it
    proc = _cli("--hf", str(hf), "--out", str(out), "--overwrite")
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(f".out{TMP_MARKER}*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert sorted(p.name for p in out.iterdir()) == ["previous", "sao_manifest.json"]
    staging = list(tmp_path.glob(f".out{TMP_MARKER}*"))
    assert len(staging) == 1, "the conversion should have been killed mid-way"
    with pytest.raises(ValueError, match=r"incomplete one .*temporary directory of an interrupted conversion"):
        read_manifest(staging[0])
