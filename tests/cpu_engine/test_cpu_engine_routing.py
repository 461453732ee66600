"""Routed experts from the CPU engine (R3), as SGLang 0.5.23 returns them: the server flag
`--enable-return-routed-experts`, the request fields `return_routed_experts` /
`routed_experts_start_len`, `meta_info.routed_experts` (base64 int32, SGLang's own decoder reads
it) covering positions `[start, seqlen - 1)`, prompt tokens included; an update landing
mid-request keeps the routing of the positions computed before it; a lost flag is an error at
the client, never silently missing routing."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megatron_sao.cpu_engine.model_runner import ModelRunner
from megatron_sao.rollout.client import EngineClient, EngineError, SamplingParams
from megatron_sao.rollout.weight_transfer import SAFETENSORS_LOAD_FORMAT, encode_safetensors_payload
from tests.rollout.engine_helpers import cpu_engine, tiny_checkpoint, tiny_checkpoint_other_seed

PROMPTS = [list(range(10, 40)), list(range(50, 57))]
LAYERS, TOPK = 2, 2  # the tiny Qwen3-MoE: every layer is MoE, top-2


def decode(out: dict) -> np.ndarray:
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    return extract_routed_experts_from_meta_info(out).reshape(-1, LAYERS, TOPK)


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("sglang")
    with cpu_engine(enable_return_routed_experts=True) as server:
        yield server


@pytest.fixture(scope="module")
def reference() -> ModelRunner:
    return ModelRunner(tiny_checkpoint(), capture_routing=True)


def plain_routing(runner: ModelRunner, token_ids: list[int]) -> np.ndarray:
    """Every position's experts from one unpadded forward of the whole sequence."""
    with torch.inference_mode(), runner.routing.recording(1, len(token_ids)) as routing_bslk:
        runner.model(input_ids=torch.tensor([token_ids]))
    return routing_bslk[0].numpy()


def same_sets(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((np.sort(a, axis=-1) == np.sort(b, axis=-1)).all())


@pytest.mark.parametrize("start", [0, 5])
def test_positions_from_start_to_the_last_fed_token(engine, reference, start):
    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True},
            "return_routed_experts": True, "routed_experts_start_len": start}
    answers = httpx.post(f"{engine.url}/generate", json=body, timeout=60).json()
    for prompt, out in zip(PROMPTS, answers, strict=True):
        sequence = prompt + out["output_ids"]
        routed = decode(out)
        assert routed.shape == (len(sequence) - 1 - start, LAYERS, TOPK)  # the last token is never fed
        # Batched, left-padded prefill and decode steps route every token as one plain forward does.
        assert same_sets(routed, plain_routing(reference, sequence)[start: len(sequence) - 1])


def test_streamed_answers_carry_routing_in_the_final_chunk(engine):
    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
            "return_routed_experts": True, "stream": True}
    with httpx.stream("POST", f"{engine.url}/generate", json=body, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert all("routed_experts" not in c["meta_info"] for c in chunks[:-1])
    assert decode(chunks[-1]).shape == (len(PROMPTS[1]) + 5 - 1, LAYERS, TOPK)


def test_bad_start_is_refused_naming_the_field(engine):
    for start, message in ((-1, "lower than 0"), (len(PROMPTS[1]) + 1, "higher than the number of input tokens")):
        response = httpx.post(f"{engine.url}/generate", timeout=30, json={
            "input_ids": PROMPTS[1], "return_routed_experts": True, "routed_experts_start_len": start})
        assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_without_the_server_flag_the_client_says_what_is_missing():
    with cpu_engine() as server:  # SGLang without --enable-return-routed-experts answers without routing
        raw = httpx.post(f"{server.url}/generate", timeout=30, json={
            "input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}).json()
        assert "routed_experts" not in raw["meta_info"]
        with pytest.raises(EngineError, match="--enable-return-routed-experts"):
            asyncio.run(EngineClient(server.url).generate(PROMPTS[1], SamplingParams(max_new_tokens=2),
                                                          return_routed_experts=True))


def test_an_update_mid_request_keeps_the_routing_computed_before_it():
    """pause(in_place) -> new weights -> continue: the positions computed before the update keep
    the old weights' routing (the same request without an update gives the same rows there); the
    later ones are the new weights'."""
    params = SamplingParams(max_new_tokens=300, ignore_eos=True, sampling_seed=3)
    other = {k: v for k, v in load_file(str(tiny_checkpoint_other_seed() / "model.safetensors")).items()}
    with cpu_engine(enable_return_routed_experts=True) as server:

        async def go():
            client = EngineClient(server.url)
            undisturbed = await client.generate(PROMPTS[0], params, return_routed_experts=True)
            task = asyncio.create_task(client.generate(PROMPTS[0], params, return_routed_experts=True))
            while (await client.get_server_info())["stats"]["generated_tokens"] < 300 + 40:
                await asyncio.sleep(0.01)
            await client.pause_generation(mode="in_place")  # the refit sequence of sglang 0.5.23
            await client.begin_weight_update()
            await client.update_weights_from_tensor([encode_safetensors_payload(other)],
                                                    load_format=SAFETENSORS_LOAD_FORMAT, weight_version="1",
                                                    flush_cache=False)
            await client.end_weight_update()
            await client.continue_generation()
            return undisturbed, await asyncio.wait_for(task, 60)

        undisturbed, updated = asyncio.run(go())
    first_new = updated.weight_version_spans[0].end  # the first output token sampled by the new weights
    assert 0 < first_new < 300
    # Output token i is sampled from position len(prompt) + i - 1: that row and later are new.
    boundary = len(PROMPTS[0]) + first_new - 1
    before = decode({"meta_info": {"routed_experts": updated.routed_experts}})
    reference = decode({"meta_info": {"routed_experts": undisturbed.routed_experts}})
    assert updated.output_ids[:first_new] == undisturbed.output_ids[:first_new]
    assert (before[:boundary] == reference[:boundary]).all()
    assert not (before[boundary:] == reference[boundary:]).all()
