"""The CPU engine's sampler: SGLang's parameter normalisation and log-prob semantics, filtering,
seeded determinism; and the KV cache surgery behind continuous batching (exact vs. a plain
forward)."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.cpu_engine.model_runner import ModelRunner
from megatron_sao.cpu_engine.sampling import (
    TOP_K_ALL,
    BatchSamplingParams,
    SamplingConfig,
    sample_tokens,
)
from tests.rollout.engine_helpers import tiny_checkpoint


def test_sglang_normalisation():
    greedy = SamplingConfig.from_request({"temperature": 0.0})
    assert (greedy.temperature, greedy.top_k, greedy.greedy) == (1.0, 1, True)
    default = SamplingConfig.from_request(None)
    assert (default.max_new_tokens, default.top_k, default.top_p) == (128, TOP_K_ALL, 1.0)
    assert SamplingConfig.from_request({"stop": "x"}).stop == ["x"]
    assert SamplingConfig.from_request({"top_k": -1}).top_k == TOP_K_ALL


@pytest.mark.parametrize(
    "params, message",
    [
        ({"bogus": 1}, "unknown sampling_params"),
        ({"n": 0}, "sampling_params.n must be in"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"json_schema": "{}"}, "json_schema"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
    ],
)
def test_refused_parameters_are_named(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig.from_request(params)


def test_neutral_values_of_unsupported_fields_are_accepted():
    SamplingConfig.from_request({"n": 1, "repetition_penalty": 1.0, "json_schema": None, "min_new_tokens": 0})


def _configs(**kw) -> list[SamplingConfig]:
    return [SamplingConfig.from_request(kw) for _ in range(3)]


def test_logprobs_are_of_the_temperature_scaled_unfiltered_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    for temperature in (1.0, 0.7):
        params = BatchSamplingParams.build(_configs(temperature=temperature, top_k=5, top_p=0.8))
        tokens, logprobs = sample_tokens(logits, params, [None] * 3)
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(1, tokens[:, None])[:, 0]
        assert torch.allclose(logprobs, expected, atol=1e-6)
        original = sample_tokens(logits, params, [None] * 3, return_original_logprob=True)
        # the "original" log-prob is of the temperature-1 distribution (SGLANG_RETURN_ORIGINAL_LOGPROB)
        expected_original = torch.log_softmax(logits, dim=-1).gather(1, original[0][:, None])[:, 0]
        assert torch.allclose(original[1], expected_original, atol=1e-6)


def test_greedy_is_argmax_with_raw_logprobs():
    logits = torch.randn(3, 50)
    tokens, logprobs = sample_tokens(logits, BatchSamplingParams.build(_configs(temperature=0.0)), [None] * 3)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).max(-1).values, atol=1e-6)


def test_top_k_and_top_p_only_sample_allowed_tokens():
    torch.manual_seed(0)
    logits = torch.randn(1, 40).repeat(400, 1)
    probs = torch.softmax(logits[0], -1)
    top5 = set(probs.topk(5).indices.tolist())
    sorted_p, order = probs.sort(descending=True)
    nucleus = set(order[: int((sorted_p.cumsum(0) < 0.6).sum()) + 1].tolist())
    for kw, allowed in (({"top_k": 5}, top5), ({"top_p": 0.6}, nucleus)):
        params = BatchSamplingParams.build([SamplingConfig.from_request(kw)] * 400)
        tokens, _ = sample_tokens(logits, params, [None] * 400)
        assert set(tokens.tolist()) <= allowed
        assert len(set(tokens.tolist())) > 1  # still sampling, not argmax


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, 64)
    config = SamplingConfig.from_request({"sampling_seed": 123})
    params = BatchSamplingParams.build([config] * 4)
    a = sample_tokens(logits, params, [torch.Generator().manual_seed(123) for _ in range(4)])[0]
    b = sample_tokens(logits[[2, 0, 3, 1]], params, [torch.Generator().manual_seed(123) for _ in range(4)])[0]
    assert a[[2, 0, 3, 1]].tolist() == b.tolist()


def test_continuous_batching_cache_matches_a_plain_forward():
    """Rows prefilled at different lengths, merged mid-decode, removed and compacted: every
    sampled token's log-prob equals the unpadded model's log-softmax (fp32, <= 1e-5)."""
    runner = ModelRunner(tiny_checkpoint())
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 40, 9)]
    cache, logits = runner.prefill(seqs)
    outs, lps = [list(s) for s in seqs], [[] for _ in seqs]
    positions = torch.tensor([len(s) for s in seqs])

    def take(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        logp = torch.log_softmax(logits, -1)
        tokens = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
        for i, row in enumerate(rows):
            outs[row].append(int(tokens[i]))
            lps[row].append(float(logp[i, tokens[i]]))
        return tokens

    active = [0, 1, 2]
    pending = take(logits, active)
    for step in range(12):
        if step == 3:  # a new request joins (shorter than the batch: it gets left-padded)
            new = torch.randint(0, 256, (7,), generator=gen).tolist()
            c2, l2 = runner.prefill([new])
            outs.append(list(new))
            lps.append([])
            cache.merge(c2)
            active.append(3)
            positions = torch.cat([positions, torch.tensor([7])])
            pending = torch.cat([pending, take(l2, [3])])
        if step == 6:  # the long row finishes: drop it and compact the leading padding
            keep = [i for i, row in enumerate(active) if row != 1]
            cache.select_rows(keep)
            assert cache.drop_unused_left_columns(min_columns=1) > 0
            active = [active[i] for i in keep]
            positions, pending = positions[keep], pending[keep]
        logits = runner.decode(cache, pending, positions)
        positions = positions + 1
        pending = take(logits, active)
    for row in range(len(outs)):
        n = len(lps[row])
        reference = runner.full_logprobs(outs[row])
        start = len(outs[row]) - n
        expected = [float(reference[start - 1 + j, outs[row][start + j]]) for j in range(n)]
        assert max(abs(a - b) for a, b in zip(lps[row], expected, strict=True)) <= 1e-5
