"""Training builds every shipped model family straight from its HF checkpoint (megatron-bridge
load, CPU block spec) and reproduces the HF model's logits (fp32, max-abs <= 1e-5)."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.platform import run_distributed

FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3", "glm_moe_dsa")


def _logits_vs_hf(hf_dirs: dict[str, str]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from megatron_sao.config import load_config
    from megatron_sao.models import build_model
    from megatron_sao.models.outputs import causal_attention_mask, position_ids_for
    from megatron_sao.platform import init_model_parallel

    diffs = {}
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    for family, hf_dir in hf_dirs.items():
        cfg = load_config(None, [f"model.hf_path={hf_dir}", "model.dtype=float32", "parallelism.world_size=1",
                                 "logging.param_table=false"])
        init_model_parallel(cfg.parallelism)
        model = build_model(cfg, "actor").chunks[0].eval()
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ours = model(ids, position_ids_for(ids), causal_attention_mask(ids.shape[1]))
            theirs = hf(ids).logits
        diffs[family] = float((ours - theirs).abs().max())
    return diffs


@pytest.mark.timeout(600)
def test_every_family_builds_for_training_with_hf_logits(tmp_path):
    from megatron_sao.utils.tiny_hf import build_tiny_hf_checkpoint

    dirs = {f: str(build_tiny_hf_checkpoint(tmp_path / f, family=f, seed=1)) for f in FAMILIES}
    (diffs,) = run_distributed(_logits_vs_hf, 1, dirs)
    for family in FAMILIES:
        assert diffs[family] <= 1e-5, (family, diffs[family])
