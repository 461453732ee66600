"""Context parallelism in the trainer: one SAO step (K = 2 critic updates, one DIS actor update)
and one SFT step with CP 2 equal the CP 1 step (losses, grad norms, explained variance within
1e-5 relative; every actor and critic parameter within 1e-6), alone and composed with TP 2 (and
sequence parallelism), EP 2, PP 2 and DP 2; a checkpoint written under CP 2 resumes under CP 1
and continues as the CP 1 run does. Gloo, CPU, tiny Qwen3-MoE, fp32, 8 recorded-style
trajectories of mixed lengths (one 8x longer than the rest) packed several per micro-batch.

Also under full and selective recomputation. CP 2 runs in the default suite; the other layouts
and the resume are slow (2-core hosts)."""

from __future__ import annotations

import math

import pytest

from megatron_sao.platform import run_distributed
from tests.training.trainer_worker import CP_PACKING, TIMING_PREFIXES, rl_and_sft_step, steps_across_checkpoint

PACKING = CP_PACKING  # why these budgets and this LR: tests/training/trainer_worker.py
CP2 = ["parallelism.context=2"]
LAYOUTS = {
    "cp2": (2, CP2),
    "cp2_tp2": (4, [*CP2, "parallelism.tensor=2"]),
    "cp2_ep2": (4, [*CP2, "parallelism.expert=2"]),
    "cp2_pp2": (4, [*CP2, "parallelism.pipeline=2"]),
    "cp2_dp2": (4, CP2),
    # Recomputation changes no number: the CP attention and the chunked logits run again in the backward.
    "cp2_full_recompute": (2, [*CP2, "model.recompute_granularity=full"]),
    "cp2_selective_recompute": (2, [*CP2, "model.recompute_granularity=selective"]),
}
RL_KEYS = ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/dis_masked_low_frac", "actor/kl_k3",
           "critic/value_loss", "critic/value_loss/last", "critic/grad_norm", "critic/grad_norm/experts",
           "critic/explained_variance", "critic/advantage_mean", "critic/value_mean")
SFT_KEYS = ("actor/loss", "actor/grad_norm", "actor/entropy")


@pytest.fixture(scope="module")
def reference(single_rank):
    """The CP 1 steps, computed in the `single_rank` process (tests/conftest.py)."""
    return single_rank["cp_reference"]


def assert_same_step(got: dict, ref: dict, keys: tuple[str, ...], roles: tuple[str, ...], what: str) -> None:
    for key in keys:
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-9), f"{what}: {key}"
    untimed = {k for k in ref["metrics"] if not k.startswith(TIMING_PREFIXES)}
    assert untimed <= set(got["metrics"]), f"{what}: metrics missing {untimed - set(got['metrics'])}"
    for role in roles:
        assert got[role].keys() == ref[role].keys()
        worst = max(float((got[role][k] - ref[role][k]).abs().max()) for k in ref[role])
        assert worst <= 1e-6, f"{what}: {role} parameters differ by {worst}"


@pytest.mark.parametrize("layout", [name if name == "cp2" else pytest.param(name, marks=pytest.mark.slow)
                                    for name in LAYOUTS])
def test_context_parallel_step_equals_cp1(layout, reference, request):
    ranks, overrides = LAYOUTS[layout]
    if layout == "cp2":  # computed in the `two_ranks` process pair (tests/conftest.py)
        got = request.getfixturevalue("two_ranks")[0]["cp2_step"]
    else:
        hf_dir = str(request.getfixturevalue("tiny_hf_dir"))
        got = run_distributed(rl_and_sft_step, ranks, hf_dir, [*PACKING, *overrides])[0]
    assert_same_step(got["rl"], reference["rl"], RL_KEYS, ("actor", "critic"), f"{layout} SAO step")
    assert_same_step(got["sft"], reference["sft"], SFT_KEYS, ("actor",), f"{layout} SFT step")
    assert got["rl"]["metrics"]["critic/optimizer_steps"] == 2
    # The step trained (a layout that changed nothing would also "match" a no-op reference).
    ref = reference["rl"]["metrics"]
    assert ref["actor/grad_norm"] > 0 and ref["critic/grad_norm"] > 0
    assert not math.isnan(ref["critic/explained_variance"])


@pytest.mark.slow
def test_resume_across_a_context_parallel_change(tiny_hf_dir, tmp_path):
    """Step 1 under CP 2, checkpoint, step 2 under CP 1 from it == steps 1-2 under CP 1."""
    hf = str(tiny_hf_dir)
    straight = run_distributed(steps_across_checkpoint, 1, hf, PACKING, 0, 2)[0]
    first = run_distributed(steps_across_checkpoint, 2, hf, [*PACKING, *CP2], 0, 1, str(tmp_path / "ckpt"))[0]
    resumed = run_distributed(steps_across_checkpoint, 1, hf, PACKING, 1, 1, "", first["saved"])[0]
    assert first["history"][0]["actor/loss"] == pytest.approx(straight["history"][0]["actor/loss"], rel=1e-5)
    for key in RL_KEYS:
        assert resumed["history"][0][key] == pytest.approx(straight["history"][1][key], rel=1e-5, abs=1e-9), key
    for role in ("actor", "critic"):
        worst = max(float((resumed[role][k] - straight[role][k]).abs().max()) for k in straight[role])
        assert worst <= 1e-6, f"{role} parameters differ by {worst} after resuming CP 2 -> CP 1"
