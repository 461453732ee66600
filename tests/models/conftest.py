"""The single-rank jobs of the model tests, computed in one spawned process (tests/one_process.py)."""

from __future__ import annotations

import pytest

from megatron_sao.platform import run_distributed
from tests.one_process import jobs_in_one_process


@pytest.fixture(scope="session")
def models_single_rank(tiny_hf_dir, tmp_path_factory) -> dict:
    """test_layouts.py's single-process actor and critic (first, as in a fresh process), then
    test_families.py's every family built with its logits against HF's."""
    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint
    from tests.models.families_worker import FAMILIES, logits_vs_hf
    from tests.models.layout_worker import run_layout

    root = tmp_path_factory.mktemp("families")
    dirs = {f: str(build_tiny_hf_checkpoint(root / f, family=f, seed=1)) for f in FAMILIES}
    jobs = {"layout_single": (run_layout, (str(tiny_hf_dir), [])), "families": (logits_vs_hf, (dirs,))}
    return run_distributed(jobs_in_one_process, 1, jobs, timeout_s=900)[0]
