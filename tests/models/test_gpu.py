"""GPU path: the same actor/critic build with NCCL, the Transformer Engine spec when installed,
bf16. Skipped on CPU machines (`gpu` marker)."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.platform import run_distributed

pytestmark = pytest.mark.gpu


def _gpu_actor_critic_step(hf_dir: str) -> dict:
    from megatron_sao.config import load_config
    from megatron_sao.models import build_model
    from megatron_sao.models.outputs import position_ids_for, values_from_head
    from megatron_sao.platform import init_model_parallel

    cfg = load_config(None, [f"model.hf_path={hf_dir}", "model.dtype=bfloat16", "parallelism.world_size=1"])
    init_model_parallel(cfg.parallelism)
    out = {}
    ids = torch.randint(0, 300, (2, 64), device="cuda")
    for role in ("actor", "critic"):
        model = build_model(cfg, role).chunks[0].cuda()
        y = model(ids, position_ids_for(ids), None)  # causal by the layers' mask type
        loss = (values_from_head(y) if role == "critic" else y.float()).pow(2).mean()
        loss.backward()
        out[role] = {"finite": bool(torch.isfinite(loss)), "device": str(y.device)}
    return out


def test_actor_and_critic_forward_backward_on_gpu(tiny_hf_dir):
    (out,) = run_distributed(_gpu_actor_critic_step, 1, str(tiny_hf_dir))
    for role in ("actor", "critic"):
        assert out[role]["finite"] and out[role]["device"].startswith("cuda")
