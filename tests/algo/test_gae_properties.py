"""Property-based tests: the fast GAE equals the per-token reference loop on random inputs.

Random shapes (including empty rows and T below and above the scan block), random masks (dense,
sparse, turn-structured), rewards anywhere, gamma and lambda in [0, 1] (scalar or per row).
Tolerance: rtol = atol = 1e-9 in float64 (both sides accumulate in float64; values up to 1e3).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sao.algo import skip_observation_gae, skip_observation_gae_reference

PROFILE = settings(max_examples=100, deadline=None)


@st.composite
def gae_inputs(draw: st.DrawFn, max_tokens: int = 200) -> dict:
    batch = draw(st.integers(1, 5))
    num_tokens = draw(st.integers(1, max_tokens))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["bernoulli", "spans"]))
    if kind == "bernoulli":
        density = draw(st.sampled_from([0.0, 0.05, 0.5, 0.95, 1.0]))
        mask = torch.rand(batch, num_tokens, generator=gen) < density
    else:
        # Alternate action / observation spans of geometric-ish lengths.
        flips = torch.rand(batch, num_tokens, generator=gen) < draw(st.sampled_from([0.02, 0.2]))
        mask = (torch.cumsum(flips.long(), dim=1) % 2 == 1)
    reward_density = draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
    scale = draw(st.sampled_from([1.0, 1e3]))
    rewards = scale * torch.randn(batch, num_tokens, generator=gen, dtype=torch.float64)
    rewards *= torch.rand(batch, num_tokens, generator=gen) < reward_density
    values = scale * torch.randn(batch, num_tokens, generator=gen, dtype=torch.float64)
    gamma = draw(st.sampled_from([0.0, 0.5, 0.99, 1.0]))
    if draw(st.booleans()):
        lam = draw(st.sampled_from([0.0, 0.3, 0.95, 1.0]))
    else:
        lam = torch.rand(batch, generator=gen, dtype=torch.float64)
        lam[torch.rand(batch, generator=gen) < 0.3] = 1.0
    return {"rewards": rewards, "values": values, "loss_mask": mask, "gamma": gamma, "lam": lam}


def _assert_matches_reference(inputs: dict) -> None:
    adv, ret = skip_observation_gae(**inputs)
    ref_adv, ref_ret = skip_observation_gae_reference(**inputs)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-9, atol=1e-9)
    mask = inputs["loss_mask"]
    assert not adv[~mask].any() and not ret[~mask].any()


@PROFILE
@given(gae_inputs())
def test_fast_gae_equals_reference_loop(inputs: dict) -> None:
    _assert_matches_reference(inputs)


@settings(max_examples=15, deadline=None)
@given(gae_inputs(max_tokens=2500))
def test_fast_gae_equals_reference_loop_on_long_rows(inputs: dict) -> None:
    # Rows longer than _BLOCK**2 = 1024 action tokens exercise the third scan level.
    _assert_matches_reference(inputs)


@PROFILE
@given(gae_inputs(max_tokens=60), st.data())
def test_inserting_observation_tokens_changes_nothing(inputs: dict, data: st.DataObject) -> None:
    rewards, values, mask = inputs["rewards"], inputs["values"], inputs["loss_mask"]
    batch, num_tokens = mask.shape
    # Insert a run of zero-reward observation tokens of random values after a random column.
    column = data.draw(st.integers(0, num_tokens))
    extra = data.draw(st.integers(1, 40))
    pad = torch.randn(batch, extra, dtype=torch.float64) * 1e3

    def insert(x: torch.Tensor, filler: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :column], filler, x[:, column:]], dim=1)

    grown = {
        **inputs,
        "rewards": insert(rewards, torch.zeros(batch, extra, dtype=torch.float64)),
        "values": insert(values, pad),
        "loss_mask": insert(mask, torch.zeros(batch, extra, dtype=torch.bool)),
    }
    adv, ret = skip_observation_gae(**inputs)
    grown_adv, grown_ret = skip_observation_gae(**grown)
    torch.testing.assert_close(grown_adv[grown["loss_mask"]], adv[mask], rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(grown_ret[grown["loss_mask"]], ret[mask], rtol=1e-12, atol=1e-9)
