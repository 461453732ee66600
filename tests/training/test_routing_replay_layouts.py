"""R3 routing replay on every layout: one SAO step with the engine's routing replayed gives the same
losses, grad norms and parameters on 1 process and in EP2, TP2 (sequence parallel), PP2 and DP2
(gloo, CPU, tiny Qwen3-MoE, fp32; EP2 in the default suite, the others slow), and every rank
receives only its part of the batch's routing."""

from __future__ import annotations

import pytest

from megatron_sao.platform import run_distributed
from tests.training.replay_worker import recomputed_replay_step, replay_step
from tests.training.test_trainer_layouts import LAYOUTS, PACKING

ROUTING_SEED = 7


@pytest.fixture(scope="module")
def reference(tiny_hf_dir):
    return run_distributed(replay_step, 1, str(tiny_hf_dir), PACKING, ROUTING_SEED)[0]


# All slow (default-suite time, issue 28): replay itself is checked by tests/training/test_routing_replay.py.
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
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


CP_LAYOUTS = {"cp2": (2, ["parallelism.context=2"]),
              "cp2_tp2": (4, ["parallelism.context=2", "parallelism.tensor=2"])}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(CP_LAYOUTS))
def test_replayed_step_under_context_parallelism_matches_single_process(layout, reference, tiny_hf_dir):
    """Each CP rank's routers see its two chunks of the sequence: the routing rank 0 cuts for it
    (routing_shards.py) must reach them through the CP micro-batch view (training/context_parallel.py)."""
    world, overrides = CP_LAYOUTS[layout]
    results = run_distributed(replay_step, world, str(tiny_hf_dir), [*PACKING, *overrides], ROUTING_SEED)
    ref, got = reference["metrics"], results[0]["metrics"]
    for key in ("actor/loss", "actor/grad_norm", "critic/value_loss", "rollout/logprob_abs_diff_mean",
                "moe/routing_agreement", "moe/replay_missing_frac"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-9), key
    for role in ("actor", "critic"):
        worst = max(float((results[0][role][k] - reference[role][k]).abs().max()) for k in reference[role])
        assert worst <= 1e-6, f"{role} parameters differ by {worst} in {layout}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "pp2"])
def test_recomputed_layers_replay_their_own_micro_batch(layout, reference, tiny_hf_dir):
    """Full activation recomputation re-runs each layer's routers in the backward; Megatron's
    REPLAY_BACKWARD gives them the routing of the micro-batch they recompute (under PP2's 1F1B
    several micro-batches are in flight): the step equals the plain replayed one."""
    world, extra = (1, []) if layout == "single" else (2, LAYOUTS["pp2"])
    result = run_distributed(recomputed_replay_step, world, str(tiny_hf_dir), [*PACKING, *extra], ROUTING_SEED)[0]
    for key in ("actor/loss", "actor/grad_norm", "rollout/logprob_abs_diff_mean", "moe/routing_agreement"):
        assert result["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-5, abs=1e-9), key
    worst = max(float((result["actor"][k] - reference["actor"][k]).abs().max()) for k in reference["actor"])
    assert worst <= 1e-6
