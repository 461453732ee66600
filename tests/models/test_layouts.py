"""Actor and critic in every parallel layout give the single-process result (fp32, <= 1e-5),
train, and keep frozen groups frozen through a real Megatron optimizer step."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.platform import run_distributed
from tests.models.layout_worker import run_layout

LAYOUTS = {
    "tp2_sp": ["parallelism.tensor=2"],
    "ep2": ["parallelism.expert=2"],
    "pp2": ["parallelism.pipeline=2"],
}


@pytest.fixture(scope="module")
def single(single_rank):
    """Computed in the `single_rank` process (tests/conftest.py)."""
    return single_rank["model_layout_single"]


# EP2 and TP2 are slow here: tests/training/test_trainer_layouts.py checks a whole step in EP2 and
# tests/training/test_logits.py TP2 with sequence parallelism in the default suite.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [pytest.param(layout, marks=pytest.mark.slow) if layout in ("ep2", "tp2_sp")
                                    else layout for layout in sorted(LAYOUTS)])
def test_layout_matches_single_process(request, single, layout):
    if layout == "pp2":  # computed in the `two_ranks` pair (tests/conftest.py)
        ranks = [r["model_layout_pp2"] for r in request.getfixturevalue("two_ranks")]
    else:
        ranks = run_distributed(run_layout, 2, str(request.getfixturevalue("tiny_hf_dir")), LAYOUTS[layout])
    for rank, res in enumerate(ranks):
        torch.testing.assert_close(res["logits"], single["logits"], rtol=0, atol=1e-5,
                                   msg=lambda m, r=rank: f"{layout} rank {r} actor logits: {m}")
        torch.testing.assert_close(res["values"], single["values"], rtol=0, atol=1e-5,
                                   msg=lambda m, r=rank: f"{layout} rank {r} critic values: {m}")
        for role in ("actor", "critic"):
            assert res[role]["applied"]
            assert res[role]["grad_norm"] == pytest.approx(single[role]["grad_norm"], rel=1e-5), (layout, role)


def test_single_process_trains_and_freezes(single):
    actor, critic = single["actor"], single["critic"]
    assert actor["num_frozen"] == 0 and not actor["trainable_unchanged"]
    # shipped default: critic attention frozen
    assert critic["num_frozen"] > 0
    assert critic["frozen_with_grad"] == []
    assert critic["frozen_changed"] == []
    assert critic["trainable_unchanged"] == []
    assert single["logits"].shape == (2, 16, 320) and single["values"].shape == (2, 16)


@pytest.mark.slow  # freezing in one process: test_single_process_trains_and_freezes (default suite)
@pytest.mark.timeout(600)
def test_freezing_holds_under_tensor_parallel(tiny_hf_dir):
    ranks = run_distributed(run_layout, 2, str(tiny_hf_dir),
                            ["parallelism.tensor=2", "critic.frozen=[attention,router]"])
    for res in ranks:
        critic = res["critic"]
        assert critic["frozen_with_grad"] == [] and critic["frozen_changed"] == []
        assert critic["trainable_unchanged"] == []
