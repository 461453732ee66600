"""Frequency / presence / repetition penalties and `logit_bias` on the CPU engine: each returned
log-prob equals a reference recomputed from the model's raw logits with sglang 0.5.23's formulas
(penalties.py), step by step (tolerance 1e-4: float32 sums reassociated by the KV cache)."""

from __future__ import annotations

import httpx
import pytest
import torch

from megatron_sao.cpu_engine.penalties import adjust_logits
from megatron_sao.cpu_engine.request import EngineRequest
from megatron_sao.cpu_engine.sampling_params import SamplingConfig
from tests.rollout.engine_helpers import cpu_engine

PROMPT = [12, 40, 41, 7]
TOL = 1e-4


@pytest.fixture(scope="module")
def engine():
    with cpu_engine() as server:
        yield server


def _raw_logits(engine, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return engine.engine.runner.model(input_ids=torch.tensor([tokens])).logits[0].float()  # [n, V]


def _reference(row: torch.Tensor, output: list[int], freq=0.0, pres=0.0, rep=1.0, bias=None) -> torch.Tensor:
    row = row.clone()
    if output:
        counts = torch.bincount(torch.tensor(output), minlength=row.shape[0]).float()
        seen = counts > 0
        row -= freq * counts
        row -= pres * seen.float()
        row = torch.where(seen, torch.where(row < 0, row * rep, row / rep), row)
    for token, b in (bias or {}).items():
        row[int(token)] += b
    return row


@pytest.mark.parametrize("params", [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"repetition_penalty": 1.8},
    {"frequency_penalty": -0.5, "presence_penalty": 0.5, "repetition_penalty": 0.7, "logit_bias": {"64": 3.0}},
])
def test_penalised_greedy_logprobs_match_the_reference(engine, params):
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True, **params}}
    answer = httpx.post(engine.url + "/generate", json=body, timeout=60).json()
    out = answer["output_ids"]
    logits = _raw_logits(engine, PROMPT + out)
    kwargs = {"freq": params.get("frequency_penalty", 0.0), "pres": params.get("presence_penalty", 0.0),
              "rep": params.get("repetition_penalty", 1.0), "bias": params.get("logit_bias")}
    for j, (lp, tok, _) in enumerate(answer["meta_info"]["output_token_logprobs"]):
        adjusted = _reference(logits[len(PROMPT) + j - 1], out[:j], **kwargs)
        assert tok == int(adjusted.argmax())
        assert abs(lp - float(torch.log_softmax(adjusted, dim=-1)[tok])) < TOL


def test_a_penalty_changes_the_greedy_output(engine):
    """A strong frequency penalty keeps greedy decoding from repeating a token it has used often."""
    def run(params):
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0.0,
                                                         "ignore_eos": True, **params}}
        return httpx.post(engine.url + "/generate", json=body, timeout=60).json()["output_ids"]

    plain, penalised = run({}), run({"frequency_penalty": 2.0, "presence_penalty": 2.0})
    assert plain != penalised
    assert max(penalised.count(t) for t in set(penalised)) <= max(plain.count(t) for t in set(plain))


def test_adjust_logits_leaves_plain_rows_untouched_and_does_not_copy_without_penalties():
    logits = torch.randn(2, 10)
    plain = [EngineRequest(rid=f"r{i}", input_ids=[1], sampling=SamplingConfig(), max_new_tokens=4) for i in range(2)]
    assert adjust_logits(logits, plain, frozenset({9})) is logits
    penalised = EngineRequest(rid="p", input_ids=[1], sampling=SamplingConfig(min_new_tokens=2, stop_token_ids=[3]),
                              max_new_tokens=4)
    out = adjust_logits(logits, [plain[0], penalised], frozenset({9}))
    assert torch.equal(out[0], logits[0])
    assert out[1, 3] == out[1, 9] == float("-inf")
    assert torch.equal(out[1, :3], logits[1, :3])
