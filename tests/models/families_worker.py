"""What the rank runs in tests/models/test_families.py: every shipped family built from its tiny HF
checkpoint, its logits against the HF model's."""

from __future__ import annotations

import torch

FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3", "glm_moe_dsa")


def logits_vs_hf(hf_dirs: dict[str, str]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from megatron_sao.config import load_config
    from megatron_sao.models import build_model
    from megatron_sao.models.outputs import position_ids_for
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
            ours = model(ids, position_ids_for(ids), None)
            theirs = hf(ids).logits
        diffs[family] = float((ours - theirs).abs().max())
    return diffs
