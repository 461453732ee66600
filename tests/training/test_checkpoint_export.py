"""training/checkpoint/export.py: a training checkpoint's actor exported by the converter
(`convert_mcore_to_hf`, what `sao demo` / `sao study` export their policies with) is a directory the
CPU engine serves, holding exactly the checkpoint's weights (not the model directory's), beside its
config and tokenizer; a checkpoint file changed since the save is refused before anything is written.
Before: the demo built a model, loaded the checkpoint and wrote safetensors by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_sao.platform import run_distributed


def save_moved_checkpoint(hf_dir: str, work: str) -> dict[str, Any]:
    """Rank job: a trainer whose actor weights are moved off the HF checkpoint's, saved as a run's
    checkpoint; the actor's HF tensors as the trainer's own exporter streams them."""
    from megatron_sao.models.hf_export import export_hf_state
    from tests.training.trainer_worker import build_trainer

    trainer = build_trainer(hf_dir, [])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for chunk in trainer.actor.chunks:
            for p in chunk.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=generator))
    trainer.save_checkpoint(Path(work) / "checkpoints", final=True)
    return {"actor": export_hf_state(trainer.actor.chunks, hf_dir, role="actor")}


@pytest.mark.slow  # a trainer build and a conversion, each on a spawned process: ~60 s on the 2-core box
@pytest.mark.timeout(900)
def test_a_run_checkpoint_exports_through_the_converter_to_a_servable_directory(tiny_hf_dir, tmp_path):
    from safetensors.torch import load_file

    from megatron_sao.cpu_engine.model_runner import ModelRunner
    from megatron_sao.cpu_engine.weights import HFWeightMap, read_hf_checkpoint
    from megatron_sao.training.checkpoint.export import export_role_hf

    (saved,) = run_distributed(save_moved_checkpoint, 1, str(tiny_hf_dir), str(tmp_path), timeout_s=600)
    want = saved["actor"]
    source = load_file(str(tiny_hf_dir / "model.safetensors"))
    assert any(not torch.equal(want[n], source[n]) for n in source), "the weights were not moved"

    out = tmp_path / "actor_hf"
    result = export_role_hf(tmp_path / "checkpoints", "actor", tiny_hf_dir, out)
    assert result["role"] == "actor" and f"-> {out}:" in result["summary"]
    got = read_hf_checkpoint(out)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    kept = {p.name for p in tiny_hf_dir.iterdir() if p.is_file() and not p.name.endswith(".safetensors")}
    assert kept <= {p.name for p in out.iterdir()}, "config or tokenizer files missing"
    assert not [p for p in tmp_path.iterdir() if ".sao-tmp-" in p.name], "staging directory left behind"

    runner = ModelRunner(out)  # what the CPU engine serves: transformers loads config, tokenizer, weights
    served = HFWeightMap(runner.model).views  # its live parameters under checkpoint names
    assert sorted(served) == sorted(want)
    assert all(torch.equal(served[name], tensor) for name, tensor in want.items())
    assert runner.tokenizer.decode(runner.tokenizer("2+3=")["input_ids"]) == "2+3="

    shard = next((tmp_path / "checkpoints").glob("iter_*/actor/*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    with pytest.raises(ValueError, match=rf"{shard.name}: checkpoint file is corrupt"):
        export_role_hf(tmp_path / "checkpoints", "actor", tiny_hf_dir, tmp_path / "again")
    assert not (tmp_path / "again").exists()
