"""EngineClient against the CPU engine over real HTTP (127.0.0.1): SGLang's /generate shape,
exact log-probs, stop handling, abort, pause / continue, health, errors."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from megatron_sao.cpu_engine.model_runner import ModelRunner
from megatron_sao.rollout.client import EngineClient, EngineError, GenerateOutput, SamplingParams
from tests.rollout.engine_helpers import cpu_engine, tiny_checkpoint

LOGPROB_TOL = 1e-5  # fp32 engine vs. fp32 reference forward


@pytest.fixture(scope="module")
def engine():
    with cpu_engine() as server:
        yield server


@pytest.fixture(scope="module")
def reference() -> ModelRunner:
    return ModelRunner(tiny_checkpoint())


def run(coro):
    return asyncio.run(coro)


def assert_logprobs_exact(reference: ModelRunner, prompt: list[int], out: GenerateOutput, temperature: float = 1.0):
    """Each returned log-prob is the model's log-softmax(logits / T) at that position."""
    assert out.output_logprobs is not None and len(out.output_logprobs) == len(out.output_ids)
    with torch.inference_mode():
        logits = reference.model(input_ids=torch.tensor([prompt + out.output_ids])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    for j, (token, lp) in enumerate(zip(out.output_ids, out.output_logprobs, strict=True)):
        assert abs(lp - float(logp[len(prompt) - 1 + j, token])) <= LOGPROB_TOL


PROMPTS = [[257, 84, 82, 68, 81, 198], list(range(10, 60)), [5, 6, 7], list(range(100, 121))]


def test_logprobs_of_sampled_tokens_equal_the_models_log_softmax(engine, reference):
    client = EngineClient(engine.url)

    async def go():
        params = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True)
        return await asyncio.gather(*(client.generate(p, params) for p in PROMPTS))  # batched together

    outs = run(go())
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.finish_reason.type == "length" and out.finish_reason.length == 24
        assert (out.prompt_tokens, out.completion_tokens) == (len(prompt), 24)
        assert out.weight_version == "0" and out.token_versions() == ["0"] * 24
        assert out.meta_info["output_token_logprobs"][0][2] is None  # SGLang: text only on request
        assert_logprobs_exact(reference, prompt, out)


def test_temperature_scaled_logprobs_match_sglangs_default(engine, reference):
    out = run(EngineClient(engine.url).generate(PROMPTS[1], SamplingParams(max_new_tokens=16, temperature=0.7)))
    assert_logprobs_exact(reference, PROMPTS[1], out, temperature=0.7)


def test_original_logprob_mode_returns_temperature_one_logprobs(reference):
    with cpu_engine(return_original_logprob=True) as server:
        params = SamplingParams(max_new_tokens=16, temperature=0.7, ignore_eos=True)
        out = run(EngineClient(server.url).generate(PROMPTS[1], params))
    assert_logprobs_exact(reference, PROMPTS[1], out, temperature=1.0)


def test_stop_token_is_kept_in_ids_and_trimmed_from_text(engine):
    client = EngineClient(engine.url)
    greedy = run(client.generate(PROMPTS[0], SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)))
    stop = greedy.output_ids[5]
    cut = greedy.output_ids.index(stop) + 1
    for no_stop_trim in (False, True):
        params = SamplingParams(max_new_tokens=32, temperature=0.0, stop_token_ids=[stop], no_stop_trim=no_stop_trim)
        out = run(client.generate(PROMPTS[0], params))
        assert out.output_ids == greedy.output_ids[:cut]
        assert out.finish_reason.type == "stop" and out.finish_reason.matched == stop
        tok = engine.engine.runner.tokenizer
        kept = out.output_ids if no_stop_trim else out.output_ids[:-1]
        assert out.text == tok.decode(kept, skip_special_tokens=True)


def test_stop_string_ends_generation(engine):
    client = EngineClient(engine.url)
    tok = engine.engine.runner.tokenizer
    greedy = run(client.generate(PROMPTS[1], SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)))
    texts = [tok.decode([t]) for t in greedy.output_ids]
    j = next(i for i, s in enumerate(texts) if i > 0 and len(s) == 1 and s.isprintable() and s.strip())
    stop = texts[j]
    j = next(i for i in range(48) if stop in tok.decode(greedy.output_ids[: i + 1]))  # first occurrence
    out = run(client.generate(PROMPTS[1], SamplingParams(max_new_tokens=48, temperature=0.0, stop=[stop])))
    assert out.output_ids == greedy.output_ids[: j + 1]
    assert out.finish_reason.type == "stop" and out.finish_reason.matched == stop
    assert stop not in out.text


def test_batch_request_answers_a_list(engine):
    body = {
        "input_ids": [PROMPTS[0], PROMPTS[2]],
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "return_logprob": True,
        "rid": "batch",
    }
    answer = httpx.post(f"{engine.url}/generate", json=body, timeout=60).json()
    assert [a["meta_info"]["id"] for a in answer] == ["batch_0", "batch_1"]
    assert all(len(a["output_ids"]) == 3 and len(a["meta_info"]["output_token_logprobs"]) == 3 for a in answer)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_ids": [1, 2], "lora_path": "adapter"}, "lora_path"),
        ({"input_ids": [1, 2], "return_hidden_states": True}, "return_hidden_states"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [1], "text": "x"}, "exactly one"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 5.0}}, "frequency_penalty"),
        ({"input_ids": list(range(300)) * 110}, "context length"),  # 33,000 tokens: the tiny model has 32,768 positions
        ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
        ({"input_ids": [1, 320]}, "vocabulary"),
    ],
)
def test_unsupported_requests_get_sglangs_400_error(engine, body, message):
    response = httpx.post(f"{engine.url}/generate", json=body, timeout=30)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_client_raises_engine_error_with_the_message(engine):
    with pytest.raises(EngineError, match="lora_path") as info:
        run(EngineClient(engine.url).generate([1, 2], {"max_new_tokens": 2}, lora_path="adapter"))
    assert info.value.status_code == 400


async def _start_long(client: EngineClient, rid: str, max_new_tokens: int = 5000) -> asyncio.Task:
    task = asyncio.create_task(
        client.generate(PROMPTS[0], SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True), rid=rid)
    )
    while (await client.get_server_info())["internal_states"][0]["num_running_reqs"] == 0:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    return task


def test_abort_by_rid_prefix_returns_the_partial_output(engine, reference):
    async def go():
        client = EngineClient(engine.url)
        task = await _start_long(client, rid="traj-7-0")
        await client.abort_request(rid="traj-7")  # SGLang matches rid prefixes
        return await asyncio.wait_for(task, 30)

    out = run(go())
    assert out.finish_reason.type == "abort"
    assert 0 < out.completion_tokens < 5000
    assert_logprobs_exact(reference, PROMPTS[0], out)


def test_pause_abort_aborts_in_flight_and_holds_new_requests_until_continue(engine):
    async def go():
        client = EngineClient(engine.url)
        running = await _start_long(client, rid="pa-1")
        await client.pause_generation(mode="abort")
        aborted = await asyncio.wait_for(running, 30)
        waiting = asyncio.create_task(client.generate(PROMPTS[2], SamplingParams(max_new_tokens=4, ignore_eos=True)))
        await asyncio.sleep(0.3)
        held = not waiting.done()
        await client.continue_generation()
        return aborted, held, await asyncio.wait_for(waiting, 30)

    aborted, held, later = run(go())
    assert aborted.finish_reason.type == "abort" and aborted.finish_reason.message == "Abort by pause_generation"
    assert held, "a request sent while paused must wait for continue_generation"
    assert later.finish_reason.type == "length" and later.completion_tokens == 4


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_in_place_and_retract_resume_without_losing_tokens(engine, reference, mode):
    async def go():
        client = EngineClient(engine.url)
        task = await _start_long(client, rid=f"pause-{mode}", max_new_tokens=400)
        await client.pause_generation(mode=mode)
        before = (await client.get_server_info())["stats"]["generated_tokens"]
        await asyncio.sleep(0.3)
        after = (await client.get_server_info())["stats"]["generated_tokens"]
        await client.continue_generation()
        return before, after, await asyncio.wait_for(task, 60)

    before, after, out = run(go())
    assert before == after, "no token may be generated while paused"
    assert out.finish_reason.type == "length" and out.completion_tokens == 400
    if mode == "retract":  # the KV was dropped and recomputed: log-probs are still the model's
        assert_logprobs_exact(reference, PROMPTS[0], out)


def test_health_info_flush_and_memory_endpoints(engine):
    async def go():
        client = EngineClient(engine.url)
        assert await client.health_generate()
        assert await client.get_weight_version() == "0"
        assert (await client.get_model_info())["weight_version"] == "0"
        assert await client.flush_cache()
        task = await _start_long(client, rid="flush", max_new_tokens=300)
        refused = not await client.flush_cache()  # SGLang refuses while requests run
        # 0.5.23's order for releasing memory: retract first (releasing asserts an idle scheduler)
        await client.pause_generation("retract")
        await client.release_memory_occupation(tags=["kv_cache", "weights"])
        await client.resume_memory_occupation(tags=["kv_cache", "weights"])
        await client.continue_generation()
        await client.abort_request(rid="flush")
        out = await task
        return refused, out.finish_reason.type

    assert run(go()) == (True, "abort")


def test_releasing_memory_while_requests_run_stops_the_engine_as_sglang_does():
    """0.5.23 asserts `is_fully_idle` in `release_memory_occupation`, inside the scheduler loop:
    the scheduler exits and the server with it. The CPU engine does the same, so a pipeline that
    releases memory after an in-place pause (requests still running) fails here too."""
    with cpu_engine() as server:
        async def go():
            client = EngineClient(server.url)
            task = await _start_long(client, rid="busy", max_new_tokens=300)
            await client.pause_generation("in_place")  # keeps the running batch: not idle
            with pytest.raises(EngineError, match="only when server is idle"):
                await client.release_memory_occupation()
            with pytest.raises(EngineError):  # the request in flight is answered with the engine's end
                await asyncio.wait_for(task, 30)
            return await client.health_generate(timeout_s=5)

        assert not run(go()) and not server.engine.scheduler.alive
        assert server.engine.scheduler.fatal_error.startswith("release_memory_occupation should be called")


def test_a_paused_engine_answers_no_health_check(monkeypatch):
    """0.5.23's health probe is a generate request that waits behind the pause: 503 after
    SGLANG_HEALTH_CHECK_TIMEOUT unless generation continues meanwhile."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    with cpu_engine() as server:
        async def go():
            client = EngineClient(server.url)
            await client.pause_generation("in_place")
            paused = await client.health_generate(timeout_s=10)
            await client.continue_generation()
            return paused, await client.health_generate(timeout_s=10)

        assert run(go()) == (False, True)


def test_dropped_client_connection_aborts_its_request(engine):
    def state():
        info = httpx.get(f"{engine.url}/server_info").json()
        return info["stats"]["aborted_requests"], info["internal_states"][0]["num_running_reqs"]

    aborted_before, _ = state()
    with pytest.raises(httpx.ReadTimeout):
        body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        httpx.post(f"{engine.url}/generate", json=body, timeout=0.5)
    deadline = time.monotonic() + 2.5  # well before the 3000 tokens could finish on their own
    while time.monotonic() < deadline:
        if state() == (aborted_before + 1, 0):
            return
        time.sleep(0.05)
    pytest.fail(f"the engine kept generating for a client that went away: {state()}")


def test_unreachable_engine_raises_unavailable():
    from megatron_sao.rollout.client import EngineUnavailableError
    from megatron_sao.rollout.engine_supervisor import free_port

    client = EngineClient(f"http://127.0.0.1:{free_port()}", connect_timeout_s=2)
    with pytest.raises(EngineUnavailableError):
        run(client.generate([1], SamplingParams(max_new_tokens=1)))
    assert not run(client.health_generate(timeout_s=2))
