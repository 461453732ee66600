"""The default-suite jobs of the trainer tests that each spawned a world of their own, computed in
one spawned process (`single_rank`) and one pair (`two_ranks`); tests/one_process.py says why."""

from __future__ import annotations

import pytest

from megatron_sao.platform import run_distributed
from tests.one_process import jobs_in_one_process
from tests.training import trainer_worker as worker


@pytest.fixture(scope="session")
def single_rank(tiny_hf_dir) -> dict:
    """One process for: the single-process references of test_trainer_layouts.py and
    test_context_parallel.py (first, so they are computed as in a fresh process), then the one-rank
    step tests of test_trainer_steps.py (warmup/K/frozen, constant-return EV, ablations, SFT)."""
    hf = str(tiny_hf_dir)
    jobs = {
        "layout_reference": (worker.one_step_in_layout, (hf, worker.LAYOUT_PACKING)),
        "cp_reference": (worker.rl_and_sft_step, (hf, worker.CP_PACKING)),
        "warmup_and_frozen": (worker.warmup_and_frozen, (hf,)),
        "constant_return": (worker.constant_return_steps, (hf,)),
        "ablations": (worker.ablation_steps, (hf,)),
        "sft": (worker.sft_steps, (hf,)),
    }
    return run_distributed(jobs_in_one_process, 1, jobs, timeout_s=900)[0]


@pytest.fixture(scope="session")
def two_ranks(tiny_hf_dir) -> list[dict]:
    """One pair of gloo processes (per rank: {job: result}) for the default-suite 2-rank jobs: first
    (in fresh processes, as when it ran alone) the emulated-device step of test_device_discipline.py
    (scoped by its context manager), then the EP2 step of test_trainer_layouts.py, the CP2 steps of
    test_context_parallel.py, the TP2 chunked logits of test_logits.py, and last (it ends in
    TrainingAborted) the NaN-on-one-rank steps of test_trainer_steps.py. Each builds its own model
    parallel state and trainer, as in processes of its own."""
    from tests.training.device_worker import STEP_OVERRIDES, step_on_emulated_device
    from tests.training.logits_worker import chunked_vs_whole

    hf = str(tiny_hf_dir)
    jobs = {
        "device_discipline": (step_on_emulated_device, (hf, STEP_OVERRIDES)),
        "ep2_step": (worker.one_step_in_layout, (hf, [*worker.LAYOUT_PACKING, "parallelism.expert=2"])),
        "cp2_step": (worker.rl_and_sft_step, (hf, [*worker.CP_PACKING, "parallelism.context=2"])),
        "logits_tp2": (chunked_vs_whole, (hf,)),
        "nan_actor": (worker.inject_nan, (hf, "actor", 1)),
    }
    return run_distributed(jobs_in_one_process, 2, jobs, timeout_s=900)
