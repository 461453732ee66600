"""Test-wide settings (threading, the `gpu` marker), the session's tiny checkpoint, and the default-suite
jobs that share one spawned process or pair (`single_rank`, `two_ranks`)."""

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


# ---- default-suite jobs that share one spawn (tests/one_process.py says why) ------------------------

@pytest.fixture(scope="session")
def single_rank(tiny_hf_dir, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One spawned process for the default suite's single-rank jobs: the single-process references
    of tests/training/test_trainer_layouts.py and test_context_parallel.py and of
    tests/models/test_layouts.py (first, so that they are computed as in a fresh process); then
    tests/training/test_trainer_steps.py's steps (warmup/K/frozen, constant-return EV, ablations,
    SFT) and tests/models/test_families.py's every family against HF."""
    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint
    from megatron_sao.platform import run_distributed
    from tests.models.families_worker import FAMILIES, logits_vs_hf
    from tests.models.layout_worker import run_layout
    from tests.one_process import jobs_in_one_process
    from tests.training import trainer_worker as worker

    hf = str(tiny_hf_dir)
    root = tmp_path_factory.mktemp("families")
    families = {f: str(build_tiny_hf_checkpoint(root / f, family=f, seed=1)) for f in FAMILIES}
    jobs = {
        "layout_reference": (worker.one_step_in_layout, (hf, worker.LAYOUT_PACKING)),
        "cp_reference": (worker.rl_and_sft_step, (hf, worker.CP_PACKING)),
        "model_layout_single": (run_layout, (hf, [])),
        "warmup_and_frozen": (worker.warmup_and_frozen, (hf,)),
        "constant_return": (worker.constant_return_steps, (hf,)),
        "ablations": (worker.ablation_steps, (hf,)),
        "sft": (worker.sft_steps, (hf,)),
        "families": (logits_vs_hf, (families,)),
    }
    return run_distributed(jobs_in_one_process, 1, jobs, timeout_s=900)[0]


@pytest.fixture(scope="session")
def two_ranks(tiny_hf_dir) -> list[dict]:
    """One pair of gloo processes (per rank: {job: result}) for the default suite's 2-rank jobs:
    first (in fresh processes, as when it ran alone) the emulated-device step of
    tests/training/test_device_discipline.py (scoped by its context manager), then the EP2 step of
    test_trainer_layouts.py, the CP2 steps of test_context_parallel.py, the TP2 chunked logits of
    test_logits.py, tests/models/test_layouts.py's PP2 actor and critic, and last (it ends in
    TrainingAborted) the NaN-on-one-rank steps of test_trainer_steps.py. Each job builds its own
    model parallel state and models, as in processes of its own."""
    from megatron_sao.platform import run_distributed
    from tests.models.layout_worker import run_layout
    from tests.one_process import jobs_in_one_process
    from tests.training import trainer_worker as worker
    from tests.training.device_worker import STEP_OVERRIDES, step_on_emulated_device
    from tests.training.logits_worker import chunked_vs_whole

    hf = str(tiny_hf_dir)
    jobs = {
        "device_discipline": (step_on_emulated_device, (hf, STEP_OVERRIDES)),
        "ep2_step": (worker.one_step_in_layout, (hf, [*worker.LAYOUT_PACKING, "parallelism.expert=2"])),
        "cp2_step": (worker.rl_and_sft_step, (hf, [*worker.CP_PACKING, "parallelism.context=2"])),
        "logits_tp2": (chunked_vs_whole, (hf,)),
        "model_layout_pp2": (run_layout, (hf, ["parallelism.pipeline=2"])),
        "nan_actor": (worker.inject_nan, (hf, "actor", 1)),
    }
    return run_distributed(jobs_in_one_process, 2, jobs, timeout_s=900)
