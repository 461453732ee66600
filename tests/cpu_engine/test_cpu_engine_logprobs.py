"""Prompt log-probs (`logprob_start_len`), `top_logprobs_num`, `token_ids_logprob` and `n > 1` on the CPU
engine, checked against an unpadded, uncached forward of the same model (tolerance 1e-4: batching and
the KV cache only reassociate float32 sums)."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.rollout.engine_helpers import cpu_engine

PROMPT = [11, 42, 7, 99, 23, 5, 61]
TOL = 1e-4


@pytest.fixture(scope="module")
def engine():
    with cpu_engine() as server:
        yield server


def _generate(engine, body):
    response = httpx.post(engine.url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _reference(engine, tokens: list[int]) -> torch.Tensor:
    return engine.engine.runner.full_logprobs(tokens)  # [n, V]: row j predicts token j + 1


@pytest.mark.parametrize("start", [0, 3, len(PROMPT) - 1])
def test_prompt_logprobs_from_logprob_start_len(engine, start):
    meta = _generate(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0},
                              "return_logprob": True, "logprob_start_len": start})["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [tok for _, tok, _ in entries] == PROMPT[start:]
    assert entries[0][0] is None  # SGLang: the first entry never has a log-prob
    ref = _reference(engine, PROMPT)
    for k, (lp, tok, _) in enumerate(entries[1:], start=start + 1):
        assert abs(lp - float(ref[k - 1, tok])) < TOL
    assert meta["output_token_logprobs"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}


def test_default_start_gives_no_prompt_entries_and_start_at_the_end_neither(engine):
    for extra in ({}, {"logprob_start_len": -1}, {"logprob_start_len": len(PROMPT)}):
        meta = _generate(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2},
                                  "return_logprob": True, **extra})["meta_info"]
        assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 2


def test_prompt_logprobs_alongside_generation_in_one_batch(engine):
    """Rows that want prompt log-probs and rows that do not share a prefill; the outputs are the same."""
    body = {"input_ids": [PROMPT, PROMPT[:4]], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
            "return_logprob": [True, False], "logprob_start_len": [1, -1]}
    with_prompt, plain = _generate(engine, body)
    alone = _generate(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}})
    assert with_prompt["output_ids"] == alone["output_ids"]
    assert len(with_prompt["meta_info"]["input_token_logprobs"]) == len(PROMPT) - 1
    assert "input_token_logprobs" not in plain["meta_info"]


def test_top_logprobs_and_token_ids_logprob(engine):
    watched = [3, 200]
    answer = _generate(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
                                "return_logprob": True, "logprob_start_len": 4, "top_logprobs_num": 3,
                                "token_ids_logprob": watched, "return_text_in_logprobs": True})
    meta, out = answer["meta_info"], answer["output_ids"]
    ref = _reference(engine, PROMPT + out)
    tokenizer = engine.engine.runner.tokenizer
    # prompt positions: [None, entries predicting PROMPT[5], PROMPT[6]]
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    for k, (tops, picks) in enumerate(zip(meta["input_top_logprobs"][1:], meta["input_token_ids_logprobs"][1:],
                                          strict=True), start=5):
        values, ids = ref[k - 1].topk(3)
        assert [t for _, t, _ in tops] == ids.tolist()
        assert all(abs(lp - v) < TOL for (lp, _, _), v in zip(tops, values.tolist(), strict=True))
        assert [[t, round(lp, 4)] for lp, t, _ in picks] == [[t, round(float(ref[k - 1, t]), 4)] for t in watched]
    # output steps: greedy, so the sampled token is the top-1 entry, and log-probs are temperature 1
    assert len(meta["output_top_logprobs"]) == len(meta["output_token_ids_logprobs"]) == 3
    for j, (tops, picks, (lp, tok, text)) in enumerate(zip(meta["output_top_logprobs"],
                                                           meta["output_token_ids_logprobs"],
                                                           meta["output_token_logprobs"], strict=True)):
        row = ref[len(PROMPT) + j - 1]
        assert tops[0][1] == tok == out[j] and abs(tops[0][0] - lp) < 1e-6 and abs(lp - float(row[tok])) < TOL
        assert text == tokenizer.decode([tok]) and tops[0][2] == text
        assert all(abs(p - float(row[t])) < TOL for p, t, _ in picks)


def test_output_top_logprobs_are_of_the_temperature_scaled_distribution(engine):
    answer = _generate(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0.5,
                                                                         "sampling_seed": 3},
                                "return_logprob": True, "top_logprobs_num": 2})
    logits_ref = torch.log_softmax(engine.engine.runner.full_logprobs(PROMPT)[-1] / 0.5, dim=-1)
    (lp, tok, _), tops = answer["meta_info"]["output_token_logprobs"][0], answer["meta_info"]["output_top_logprobs"][0]
    assert abs(lp - float(logits_ref[tok])) < TOL
    assert [t for _, t, _ in tops] == logits_ref.topk(2).indices.tolist()


def test_n_samples_per_prompt_prompt_major(engine):
    body = {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": {"max_new_tokens": 4, "n": 3, "ignore_eos": True},
            "return_logprob": True, "rid": "parallel"}
    answers = _generate(engine, body)
    assert len(answers) == 6
    assert [a["meta_info"]["prompt_tokens"] for a in answers] == [len(PROMPT)] * 3 + [3] * 3
    assert len({a["meta_info"]["id"] for a in answers}) == 6  # fresh ids, as SGLang's tokenizer manager
    assert all(len(a["output_ids"]) == 4 and len(a["meta_info"]["output_token_logprobs"]) == 4 for a in answers)
    assert len({tuple(a["output_ids"]) for a in answers[:3]}) > 1  # independent samples
    single = _generate(engine, {"text": "hello", "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert isinstance(single, list) and len(single) == 2


def test_n_with_per_prompt_logprob_lists_is_refused(engine):
    response = httpx.post(engine.url + "/generate", timeout=30, json={
        "input_ids": [PROMPT, PROMPT], "sampling_params": {"n": 2}, "return_logprob": [True, False]})
    assert response.status_code == 400 and "return_logprob" in response.json()["error"]["message"]
