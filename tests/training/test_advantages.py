"""`algorithm.advantage_norm` on a batch's critic advantages (`training/advantages.py`)."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.training.advantages import normalize_advantage_rows


def _rows_and_sums():
    gen = torch.Generator().manual_seed(0)
    rows = {i: torch.randn(5 + i, generator=gen, dtype=torch.float64) * 0.3 + 0.2 for i in range(4)}
    masks = {i: torch.rand(5 + i, generator=gen) < 0.7 for i in rows}
    action = torch.cat([rows[i][masks[i]] for i in rows])
    return rows, masks, float(action.sum()), float(action.square().sum()), float(action.numel())


@pytest.mark.parametrize("mode", ["mean", "whiten"])
def test_normalised_over_the_batch_action_tokens(mode):
    rows, masks, total, squares, count = _rows_and_sums()
    out = normalize_advantage_rows(rows, total, squares, count, mode)
    action = torch.cat([out[i][masks[i]] for i in out])
    assert float(action.mean()) == pytest.approx(0.0, abs=1e-12)
    before = torch.cat([rows[i][masks[i]] for i in rows])
    expected_std = 1.0 if mode == "whiten" else float(before.std(unbiased=False))
    assert float(action.std(unbiased=False)) == pytest.approx(expected_std, rel=1e-5)


def test_none_and_empty_batches_are_untouched_and_bad_modes_refused():
    rows, _, total, squares, count = _rows_and_sums()
    assert normalize_advantage_rows(rows, total, squares, count, "none") is rows
    assert normalize_advantage_rows(rows, 0.0, 0.0, 0.0, "whiten") is rows
    with pytest.raises(ValueError, match="advantage_norm"):
        normalize_advantage_rows(rows, total, squares, count, "rank")
