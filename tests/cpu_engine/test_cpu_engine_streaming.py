"""`stream: true` on the CPU engine: SGLang's `data: {...}` events ending with `data: [DONE]`,
cumulative text / ids / log-probs, `index` for batches, `stream_interval`, and an abort when the
client goes away."""

from __future__ import annotations

import itertools
import json
import time

import httpx
import pytest

from tests.rollout.engine_helpers import cpu_engine

PROMPT = [21, 22, 23, 24, 25]


@pytest.fixture(scope="module")
def engine():
    with cpu_engine() as server:
        yield server


def _stream(engine, body) -> tuple[list[dict], list[str]]:
    """The decoded events and the raw non-empty lines of one streamed /generate."""
    with httpx.stream("POST", engine.url + "/generate", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    return [json.loads(line[len("data: "):]) for line in lines[:-1]], lines


def test_stream_is_cumulative_and_ends_like_the_plain_answer(engine):
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}}
    events, _ = _stream(engine, body)
    plain = httpx.post(engine.url + "/generate", json=body, timeout=60).json()
    assert len(events) >= 2
    for before, after in itertools.pairwise(events):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    last = events[-1]
    assert last["output_ids"] == plain["output_ids"] and last["text"] == plain["text"]
    assert last["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert [tok for _, tok, _ in last["meta_info"]["output_token_logprobs"]] == plain["output_ids"]
    for (lp, _, _), (ref, _, _) in zip(last["meta_info"]["output_token_logprobs"],
                                        plain["meta_info"]["output_token_logprobs"], strict=True):
        assert abs(lp - ref) < 1e-4
    for e in events:  # every chunk is self-consistent
        meta = e["meta_info"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(e["output_ids"])
        assert meta["weight_versions"][-1]["end"] == len(e["output_ids"])


def test_stream_never_shows_a_stop_string_it_will_trim(engine):
    bias = {"64": 50.0, "65": 50.0, "66": 50.0}  # the output is a string of a, b and c
    base = httpx.post(engine.url + "/generate", timeout=60, json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "logit_bias": bias,
                                                 "ignore_eos": True}}).json()["text"]
    stop = base[4:7]
    events, _ = _stream(engine, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "logit_bias": bias, "stop": stop}})
    final = events[-1]["text"]
    assert stop not in final and final == base[: base.find(stop)]
    assert all(final.startswith(e["text"]) for e in events)


def test_batch_and_n_streams_tag_each_chunk_with_its_index(engine):
    body = {"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": {"max_new_tokens": 4, "n": 2, "ignore_eos": True}}
    events, _ = _stream(engine, body)
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    assert [finals[i]["meta_info"]["prompt_tokens"] for i in range(4)] == [5, 5, 2, 2]
    assert all(len(f["output_ids"]) == 4 for f in finals.values())


def test_stream_interval(engine):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "stream_interval": 4}}
    events, _ = _stream(engine, body)
    sizes = [len(e["output_ids"]) for e in events]
    assert sizes[-1] == 12 and len(events) <= 4
    assert all(b - a >= 4 for a, b in itertools.pairwise(sizes[:-1]))


def test_an_invalid_stream_request_is_a_plain_400(engine):
    response = httpx.post(engine.url + "/generate", timeout=30,
                          json={"input_ids": PROMPT, "stream": True, "sampling_params": {"regex": "x"}})
    assert response.status_code == 400 and "regex" in response.json()["error"]["message"]


def test_a_client_that_goes_away_aborts_its_request(engine):
    sched = engine.engine.scheduler
    body = {"input_ids": PROMPT, "stream": True, "rid": "walk-away",
            "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True}}
    with httpx.stream("POST", engine.url + "/generate", json=body, timeout=60) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    deadline = time.monotonic() + 20
    while sched.load()["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sched.load() == {"num_running_reqs": 0, "num_waiting_reqs": 0}
    assert sched.stats.aborted_requests >= 1


def test_stream_never_shows_a_stop_token_it_will_trim(engine):
    bias = {"64": 50.0, "65": 50.0, "66": 50.0}  # the output is a string of a (64), b (65) and c (66)
    params = {"max_new_tokens": 16, "temperature": 0.0, "logit_bias": bias}
    base = httpx.post(engine.url + "/generate", timeout=60, json={
        "input_ids": PROMPT, "sampling_params": {**params, "ignore_eos": True}}).json()["text"]
    stop_token = 64 + "abc".index(base[5])
    for _ in range(3):  # whether a chunk falls between a token and its finish depends on timing
        body = {"input_ids": PROMPT, "sampling_params": {**params, "stop_token_ids": [stop_token]}}
        events, _ = _stream(engine, body)
        final = events[-1]
        assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
        assert final["text"] == base[: base.index(base[5])]
        assert all(final["text"].startswith(e["text"]) for e in events)


def test_incremental_streaming_output():
    """SGLang's --incremental-streaming-output: chunks carry only what is new."""
    with cpu_engine(incremental_streaming_output=True) as server:
        body = {"input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 9, "temperature": 0.0, "ignore_eos": True}}
        events, _ = _stream(server, body)
        plain = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert len(events) >= 2
    assert "".join(e["text"] for e in events) == plain["text"]
    assert [t for e in events for t in e["output_ids"]] == plain["output_ids"]
    assert [t for e in events for _, t, _ in e["meta_info"]["output_token_logprobs"]] == plain["output_ids"]
    assert events[-1]["meta_info"]["completion_tokens"] == 9
