"""No single bad input takes the CPU engine down (issue 14, findings 1 and 3): every request is
validated whole before admission (a 4xx naming the field, never a 500 or a coercion), a failure
while serving one request fails that request alone with an answer, prompt size is bounded before
tokenisation (done off the event loop), health answers within a second, the process stops on the
first SIGINT, and the client detects a hung engine."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sao.cpu_engine.request import EngineRequest
from megatron_sao.cpu_engine.sampling import SamplingConfig
from megatron_sao.rollout.client import EngineClient, EngineUnavailableError, SamplingParams
from megatron_sao.rollout.engine_supervisor import free_port
from tests.rollout.engine_helpers import cpu_engine, tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
HEALTH_BUDGET_S = 1.0  # issue 14: health endpoints answer within a second under any load
LEGIT = {"input_ids": [257, 84, 82, 68], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}


@pytest.fixture(scope="module")
def engine():
    with cpu_engine() as server:
        yield server


def _post(url: str, body: object = None, content: bytes | None = None, timeout: float = 60.0) -> httpx.Response:
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(url + "/generate", content=content, headers={"content-type": "application/json"},
                      timeout=timeout)


class LegitTraffic:
    """Well-formed requests sent back to back on a thread; every one must come back complete."""

    def __init__(self, url: str, workers: int = 4) -> None:
        self.url, self.stop, self.answers, self.failures = url, threading.Event(), 0, []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _run(self) -> None:
        while not self.stop.is_set():
            r = _post(self.url, LEGIT)
            meta = r.json().get("meta_info", {}) if r.status_code == 200 else {}
            if r.status_code != 200 or meta.get("finish_reason", {}).get("type") != "length":
                self.failures.append((r.status_code, r.text[:200]))
            else:
                self.answers += 1

    def __enter__(self) -> LegitTraffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


# ---- finding 1: a NaN temperature ----------------------------------------------------------------


@pytest.mark.parametrize("raw", ["NaN", '"nan"', "Infinity", "-1", '"0.7"', "true", "[1]"])
def test_bad_temperature_gets_a_400_and_everyone_else_is_answered(engine, raw):
    body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": ' + raw.encode() + b"}}"
    with LegitTraffic(engine.url) as legit:
        time.sleep(0.3)
        response = _post(engine.url, content=body)
        time.sleep(0.3)
    assert response.status_code == 400, response.text
    assert "sampling_params.temperature" in response.json()["error"]["message"]
    assert legit.failures == [] and legit.answers > 0


def test_a_request_that_fails_inside_the_engine_fails_alone(engine):
    """Bypassing validation, a NaN temperature reaches the sampler: that request alone is answered
    with an engine-error abort; the 16 requests batched with it finish normally."""
    client = EngineClient(engine.url)
    sched = engine.engine.scheduler
    poisoned = EngineRequest(rid="poisoned", input_ids=[5, 6, 7], sampling=SamplingConfig(temperature=float("nan")),
                             max_new_tokens=8)

    async def go():
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        tasks = [asyncio.create_task(client.generate([10 + i, 11, 12], params)) for i in range(16)]
        await asyncio.sleep(0.05)
        sched.submit(poisoned)
        return await asyncio.gather(*tasks), await asyncio.wait_for(asyncio.wrap_future(poisoned.future), 60)

    outs, failed = asyncio.run(go())
    assert all(o.finish_reason.type == "length" and o.completion_tokens == 12 for o in outs)
    assert failed.finish_reason["type"] == "abort" and failed.finish_reason["status_code"] == 500
    assert "engine error while serving this request" in failed.finish_reason["message"]
    assert httpx.get(engine.url + "/health_generate", timeout=5).status_code == 200


def test_a_prefill_failure_fails_only_its_request(engine, monkeypatch):
    runner = engine.engine.runner
    original = runner.prefill

    def prefill(sequences):
        if any(seq[:3] == [13, 13, 13] for seq in sequences):
            raise RuntimeError("injected prefill failure")
        return original(sequences)

    monkeypatch.setattr(runner, "prefill", prefill)
    client = EngineClient(engine.url)

    async def go():
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        prompts = [[13, 13, 13, 1]] + [[20 + i, 21, 22, 23] for i in range(7)]
        return await asyncio.gather(*(client.generate(p, params) for p in prompts))

    bad, *good = asyncio.run(go())
    assert bad.finish_reason.type == "abort" and "injected prefill failure" in (bad.finish_reason.message or "")
    assert all(o.finish_reason.type == "length" and o.completion_tokens == 6 for o in good)


# ---- finding 3: a large text prompt --------------------------------------------------------------


def test_a_huge_text_prompt_is_refused_before_tokenisation_and_health_stays_fast(engine):
    limit = engine.engine.limits.max_prompt_chars
    text = "hello world " * (20_000_000 // 12)  # 20 MB: tokenising it would take minutes
    result: dict[str, object] = {}

    def send() -> None:
        start = time.monotonic()
        result["response"] = _post(engine.url, {"text": text, "sampling_params": {"max_new_tokens": 1}})
        result["seconds"] = time.monotonic() - start

    sender = threading.Thread(target=send)
    sender.start()
    worst = 0.0
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(engine.url + "/health", timeout=5).status_code == 200
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.05)
    sender.join()
    response = result["response"]
    assert response.status_code == 400  # type: ignore[union-attr]
    message = response.json()["error"]["message"]  # type: ignore[union-attr]
    assert f"the limit is {limit} characters" in message and message.startswith("text:")
    assert result["seconds"] < 30 and worst < HEALTH_BUDGET_S


def test_a_text_prompt_at_the_limit_is_tokenised_off_the_event_loop(engine):
    """Just under the character limit (tokenisation takes a while): health answers meanwhile."""
    text = "ab " * (engine.engine.limits.max_prompt_chars // 3)
    done = threading.Event()
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: (answers.append(_post(engine.url, {"text": text})), done.set()))
    sender.start()
    latencies = []
    while not done.is_set():
        start = time.monotonic()
        httpx.get(engine.url + "/health", timeout=5)
        latencies.append(time.monotonic() - start)
    sender.join()
    assert answers[0].status_code == 400 and "context length" in answers[0].json()["error"]["message"]
    assert max(latencies) < HEALTH_BUDGET_S


def test_a_body_over_the_size_limit_gets_413():
    with cpu_engine(max_request_bytes=1 << 20) as server:
        response = _post(server.url, {"input_ids": [1] * 400_000})
        assert response.status_code == 413 and "exceeds the engine's limit" in response.json()["error"]["message"]
        assert _post(server.url, LEGIT).status_code == 200


@pytest.mark.parametrize("content, message", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe\x00", "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"input_ids": [1, true]}', "input_ids: token ids must be integers"),
    (b'{"input_ids": [1, 2.5]}', "input_ids: token ids must be integers"),
    (b'{"input_ids": [[1], [2]], "sampling_params": [{}, 3]}', "sampling_params[1] must be a JSON object"),
    (b'{"input_ids": [1], "rid": {"a": 1}}', "rid must be a string"),
    (b'{"input_ids": [1], "return_logprob": "yes"}', "return_logprob must be true or false"),
    (b'{"input_ids": [1], "sampling_params": {"stop": [1]}}', "sampling_params.stop must be a string"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}', "max_new_tokens must be an integer"),
    (b'{"text": ["a", 7]}', "text[1] must be a non-empty string"),
])
def test_malformed_bodies_get_a_400_naming_the_problem(engine, content, message):
    response = _post(engine.url, content=content)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


# ---- the property test ----------------------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_fields = st.sampled_from(["text", "input_ids", "sampling_params", "rid", "return_logprob", "stream",
                           "logprob_start_len", "return_text_in_logprobs", "priority", "bogus"])
_sampling = st.dictionaries(st.sampled_from(["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                                             "stop_token_ids", "ignore_eos", "n", "sampling_seed", "x"]),
                            _json_values, max_size=4)
_bodies = st.one_of(
    _json_values,
    st.dictionaries(_fields, _json_values, max_size=5),
    st.builds(lambda extra, sp: {"input_ids": [1, 2, 3], "sampling_params": sp, **extra},
              st.dictionaries(_fields.filter(lambda f: f not in ("input_ids", "text", "sampling_params")),
                              _json_values, max_size=2), _sampling),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies)
def test_random_json_never_gets_a_5xx_while_legitimate_requests_complete(engine, body):
    content = json.dumps(body, allow_nan=True).encode()
    with LegitTraffic(engine.url, workers=2) as legit:
        response = _post(engine.url, content=content)
    assert response.status_code in (200, 400, 413), (content[:300], response.status_code, response.text[:300])
    if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line]
        assert events[-1] == "[DONE]" and all("meta_info" in json.loads(e) for e in events[:-1]), events[-2:]
    elif response.status_code == 200:  # a body that happened to be valid got a real answer
        outs = response.json()
        assert all("meta_info" in o for o in (outs if isinstance(outs, list) else [outs]))
    else:
        assert response.json()["error"]["message"]
    assert legit.failures == []
    assert httpx.get(engine.url + "/health_generate", timeout=5).status_code == 200


# ---- stopping and the client's timeouts -----------------------------------------------------------


def test_engine_process_prints_ready_and_stops_on_the_first_sigint(tmp_path):
    port = free_port()
    log = tmp_path / "engine.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_sao.cpu_engine", "--model", str(tiny_checkpoint()), "--port",
         str(port), "--log-file", str(log)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert first == f"ready on http://127.0.0.1:{port}", first
        url = f"http://127.0.0.1:{port}"
        answers: list[httpx.Response] = []
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        sender = threading.Thread(target=lambda: answers.append(_post(url, body, timeout=120)))
        sender.start()
        deadline = time.monotonic() + 30
        while httpx.get(url + "/get_server_info").json()["internal_states"][0]["num_running_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=20)
        sender.join(timeout=20)
        assert time.monotonic() - start < 10 and code == 130
        assert answers and answers[0].status_code == 503  # the request in flight was answered
        assert "shutting down" in answers[0].json()["error"]["message"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()  # type: ignore[union-attr]
    assert "Traceback" not in stderr and "warn" not in stderr.lower(), stderr
    assert log.stat().st_size > 0  # third-party output went to the log file


def test_client_detects_a_hung_engine_with_its_read_timeout():
    """An engine that accepts the connection and never answers: EngineUnavailableError after the
    read timeout, not a wait forever."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=0.5, generate_timeout_s=1.0)
        start = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="ReadTimeout"):
            asyncio.run(client.generate([1, 2], SamplingParams(max_new_tokens=1)))
        assert time.monotonic() - start < 5
        with pytest.raises(EngineUnavailableError, match="ReadTimeout"):
            asyncio.run(client.get_weight_version())
    finally:
        listener.close()


def test_client_timeouts_are_finite_by_default():
    client = EngineClient("http://127.0.0.1:1")
    assert client.timeouts == {"connect": 10.0, "read": 60.0, "generate_read": 3600.0}
    with pytest.raises(ValueError, match="generate_timeout_s"):
        EngineClient("http://127.0.0.1:1", generate_timeout_s=float("nan"))


def test_sampler_row_isolation_unit():
    """`sample_rows_isolated` gives the broken row its exception and the others their tokens."""
    from megatron_sao.cpu_engine.sampling import BatchSamplingParams, sample_rows_isolated

    configs = [SamplingConfig(), SamplingConfig(temperature=float("nan")), SamplingConfig()]
    logits = torch.randn(3, 50)
    tokens, results = sample_rows_isolated(logits, BatchSamplingParams.build(configs), configs, [None] * 3,
                                           torch.Generator().manual_seed(0))
    assert isinstance(results[1], RuntimeError)
    assert all(isinstance(results[i], float) for i in (0, 2)) and 0 <= int(tokens[0]) < 50


def test_client_turns_a_malformed_answer_into_an_engine_error():
    """A /generate answer with a mistyped field is the engine's error, not a crash in the caller."""
    from megatron_sao.rollout.client import EngineError

    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"meta_info": {"finish_reason": {}},
                                                                              "output_ids": ["x"]}))
    client = EngineClient("http://engine")

    async def go():
        client._client = httpx.AsyncClient(base_url="http://engine", transport=transport)
        client._client_loop = asyncio.get_running_loop()
        return await client.generate([1], SamplingParams())

    with pytest.raises(EngineError, match="malformed /generate answer"):
        asyncio.run(go())
