"""Test-wide settings: CPU-friendly threading and the `gpu` marker."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# Tests compare forwards computed in different buffers bit for bit (verify: the streamed HF forward
# against the whole model's). On AVX-512 hosts MKL's float GEMMs give other last bits at another
# memory alignment unless its strict reproducibility mode is on (seen on the 2-core CI VM kind,
# 2026-12-02: ~1e-9 differences); spawned ranks inherit it.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Qwen3-MoE HF checkpoint (2 layers, 4 experts), built once per session."""
    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint

    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)
