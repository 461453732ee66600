"""R3 routing replay on every layout: one SAO step with the engine's routing replayed gives the same
losses, grad norms and parameters on 1 process and in EP2, TP2 (sequence parallel), PP2 and DP2
(gloo, CPU, tiny Qwen3-MoE, fp32; EP2 in the default suite, the others slow), and every rank
receives only its part of the batch's routing."""

from __future__ import annotations

import pytest

from megatron_sao.platform import run_distributed
from tests.training.test_trainer_layouts import LAYOUTS, PACKING
from tests.training.trainer_worker import replay_step

ROUTING_SEED = 7


@pytest.fixture(scope="module")
def reference(tiny_hf_dir):
    return run_distributed(replay_step, 1, str(tiny_hf_dir), PACKING, ROUTING_SEED)[0]


@pytest.mark.parametrize("layout", [layout if layout == "ep2" else pytest.param(layout, marks=pytest.mark.slow)
                                    for layout in LAYOUTS])
def test_replayed_step_matches_single_process(layout, reference, tiny_hf_dir):
    results = run_distributed(replay_step, 2, str(tiny_hf_dir), [*PACKING, *LAYOUTS[layout]], ROUTING_SEED)
    ref, got = reference["metrics"], results[0]["metrics"]
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy", "critic/value_loss", "critic/grad_norm",
                "rollout/logprob_abs_diff_mean", "moe/routing_agreement", "moe/replay_missing_frac"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-9), key
    for role in ("actor", "critic"):
        worst = max(float((results[0][role][k] - reference[role][k]).abs().max()) for k in reference[role])
        assert worst <= 1e-6, f"{role} parameters differ by {worst} in {layout}"
    # Routing was replayed (agreement with random routing is far from 1) and partly missing.
    assert ref["moe/routing_agreement"] < 0.5 and 0 < ref["moe/replay_missing_frac"] < 1
    # No rank receives the whole batch's routing: each gets its DP share, its stage's layers or its
    # sequence part (the 1-process rank receives all of it, padded).
    assert got["moe/replay_rank_mb_max"] < 0.75 * ref["moe/replay_rank_mb_max"]
