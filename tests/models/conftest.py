from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megatron_sao.utils.tiny_hf import build_tiny_hf_checkpoint

    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)
