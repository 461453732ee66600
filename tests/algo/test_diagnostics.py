"""Diagnostics: staleness histogram, DIS masking split by staleness, grad norm per group."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_sao.algo import (
    ATTENTION_MOE_PATTERNS,
    grad_norm_by_group,
    grad_sq_norms_by_group,
    masked_fraction_by_staleness,
    staleness_histogram,
)

VERSIONS = torch.tensor([[5, 5, 4, 4, 9], [3, 3, 3, 0, 0]])
MASK = torch.tensor([[True, True, True, False, False], [True, True, False, True, False]])


def test_staleness_histogram_counts_action_tokens_only() -> None:
    # current 5: row 0 ages 0, 0, 1 (+ masked tokens, one of them "from the future"); row 1 ages 2, 2, 5.
    assert staleness_histogram(VERSIONS, 5, MASK).tolist() == [2, 1, 2, 0, 0, 1]
    assert staleness_histogram(VERSIONS, 5, MASK, max_staleness=2).tolist() == [2, 1, 3]
    assert staleness_histogram(VERSIONS, 5, torch.zeros_like(MASK)).tolist() == [0]


def test_staleness_rejects_tokens_newer_than_the_actor() -> None:
    with pytest.raises(ValueError, match="policy_versions"):
        staleness_histogram(VERSIONS, 4, MASK)
    with pytest.raises(ValueError, match="policy_versions"):
        staleness_histogram(VERSIONS.float(), 5, MASK)
    with pytest.raises(ValueError, match="max_staleness"):
        staleness_histogram(VERSIONS, 5, MASK, max_staleness=-1)


def test_masked_fraction_by_staleness() -> None:
    rho = torch.tensor([[1.0, 0.5, 7.0, 1.0, 1.0], [0.6, 1.0, 0.1, 9.0, 1.0]], dtype=torch.float64)
    counts = masked_fraction_by_staleness(rho.log(), torch.zeros_like(rho), VERSIONS, 5, MASK, eps_low=0.3,
                                          eps_high=5.0, max_staleness=3)
    assert counts.num_tokens.tolist() == [2, 1, 2, 1]
    assert counts.masked_low.tolist() == [1, 0, 1, 0]  # rho 0.5 at age 0, 0.6 at age 2
    assert counts.masked_high.tolist() == [0, 1, 0, 1]  # rho 7 at age 1, 9 at age 5 (binned to 3)
    log = counts.fractions()
    assert log["dis/staleness_0/masked_low_frac"] == 0.5
    assert log["dis/staleness_2/masked_low_frac"] == 0.5
    assert log["dis/staleness_3/masked_high_frac"] == 1.0
    assert log["dis/staleness_1/num_tokens"] == 1.0


def test_masked_fraction_of_an_empty_bin_is_nan() -> None:
    counts = masked_fraction_by_staleness(torch.zeros(2, 5), torch.zeros(2, 5), VERSIONS, 5, MASK, 0.3, 5.0)
    log = counts.fractions(prefix="s")
    assert math.isnan(log["s3/masked_low_frac"]) and log["s3/num_tokens"] == 0.0


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attention = torch.nn.Linear(2, 2, bias=False)
        self.experts = torch.nn.Linear(2, 2, bias=False)
        self.norm = torch.nn.LayerNorm(2)
        self.frozen = torch.nn.Linear(2, 2, bias=False)


def _model_with_grads() -> torch.nn.Module:
    model = torch.nn.Sequential(_Block())
    block = model[0]
    block.self_attention.weight.grad = torch.full((2, 2), 3.0)  # norm 6
    block.experts.weight.grad = torch.full((2, 2), 4.0)  # norm 8
    block.norm.weight.grad = torch.tensor([1.0, 2.0])
    block.norm.bias.grad = torch.tensor([0.0, 2.0])  # "other": norm 3
    block.frozen.weight.requires_grad_(False)  # no grad: skipped
    return model


def test_grad_norm_by_group_with_regex_mapping() -> None:
    model = _model_with_grads()
    norms = grad_norm_by_group(model.named_parameters(), {"attention": r"self_attention\.", "moe": r"experts\."})
    assert norms == pytest.approx({"attention": 6.0, "moe": 8.0, "other": 3.0, "total": math.sqrt(36 + 64 + 9)})


def test_grad_norm_by_group_with_callable_and_default_patterns() -> None:
    model = _model_with_grads()
    by_callable = grad_norm_by_group(model.named_parameters(),
                                     lambda name: "attention" if "attention" in name else None, default_group="rest")
    assert by_callable == pytest.approx({"attention": 6.0, "rest": math.sqrt(64 + 9), "total": math.sqrt(109)})
    by_default = grad_norm_by_group(model.named_parameters(), ATTENTION_MOE_PATTERNS)
    assert by_default == pytest.approx({"attention": 6.0, "moe": 8.0, "other": 3.0, "total": math.sqrt(109)})


def test_grad_sq_norms_are_summable_tensors() -> None:
    sq = grad_sq_norms_by_group(_model_with_grads().named_parameters(), ATTENTION_MOE_PATTERNS)
    assert {k: v.item() for k, v in sq.items()} == pytest.approx({"attention": 36.0, "moe": 64.0, "other": 9.0})


def test_grad_norm_without_gradients_and_reserved_name() -> None:
    assert grad_norm_by_group(torch.nn.Linear(2, 2).named_parameters(), {}) == {"total": 0.0}
    with pytest.raises(ValueError, match="total"):
        grad_norm_by_group(_model_with_grads().named_parameters(), lambda name: "total")
