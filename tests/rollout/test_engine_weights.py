"""Weight updates on the CPU engine through the client: from disk, from a safetensors tensor
payload, from a gloo process group; each changes the weight version and the outputs, and a
mid-generation update splits the answer's per-token version spans."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from safetensors.torch import load_file

from megatron_sao.rollout.client import EngineClient, EngineError, SamplingParams
from megatron_sao.rollout.engine_supervisor import free_port
from megatron_sao.rollout.weight_transfer import (
    SAFETENSORS_LOAD_FORMAT,
    broadcast_tensors,
    create_weight_update_group,
    dtype_name,
    encode_safetensors_payload,
)
from tests.rollout.engine_helpers import cpu_engine, tiny_checkpoint, tiny_checkpoint_other_seed

PROMPT = list(range(10, 40))
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def outputs_of_b() -> list[int]:
    """Greedy output of checkpoint B (different weights), from an engine that loaded B."""
    with cpu_engine(tiny_checkpoint_other_seed()) as server:
        return run(EngineClient(server.url).generate(PROMPT, GREEDY)).output_ids


def _tensors(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_update_from_disk_changes_version_and_outputs(outputs_of_b):
    with cpu_engine() as server:

        async def go():
            client = EngineClient(server.url)
            before = await client.generate(PROMPT, GREEDY)
            result = await client.update_weights_from_disk(str(tiny_checkpoint_other_seed()), weight_version="1")
            after = await client.generate(PROMPT, GREEDY)
            version = await client.get_weight_version()
            await client.update_weights_from_disk(str(tiny_checkpoint()), weight_version="2")
            back = await client.generate(PROMPT, GREEDY)
            return before, result, after, version, back

        before, result, after, version, back = run(go())
    assert result["success"] and "num_paused_requests" in result
    assert version == "1" and after.weight_version == "1" and after.token_versions() == ["1"] * 24
    assert after.output_ids == outputs_of_b != before.output_ids
    assert back.output_ids == before.output_ids and back.weight_version == "2"


def test_update_from_tensor_payload_full_and_partial(outputs_of_b):
    other = _tensors(tiny_checkpoint_other_seed())
    with cpu_engine() as server:

        async def go():
            client = EngineClient(server.url)
            before = await client.generate(PROMPT, GREEDY)
            one_expert = {k: v for k, v in other.items() if k == "model.layers.1.mlp.experts.2.up_proj.weight"}
            await client.begin_weight_update()  # 0.5.23: tensor updates only inside a session
            await client.update_weights_from_tensor(
                [encode_safetensors_payload(one_expert)], load_format=SAFETENSORS_LOAD_FORMAT, weight_version="1"
            )
            partial = await client.generate(PROMPT, GREEDY)
            await client.update_weights_from_tensor(
                [encode_safetensors_payload(other)], load_format=SAFETENSORS_LOAD_FORMAT, weight_version="2"
            )
            await client.end_weight_update()
            full = await client.generate(PROMPT, GREEDY)
            return before, partial, full

        before, partial, full = run(go())
    assert partial.weight_version == "1" and partial.output_ids != before.output_ids  # one expert matters
    assert full.weight_version == "2" and full.output_ids == outputs_of_b


def test_bad_tensor_updates_are_refused_before_anything_changes():
    with cpu_engine() as server:

        async def go():
            client = EngineClient(server.url)
            before = await client.generate(PROMPT, GREEDY)
            bad = {
                "model.embed_tokens.weight": torch.zeros(320, 64),  # fine on its own...
                "model.layers.0.not_a_weight": torch.zeros(2),  # ...but this name is unknown
            }
            errors = []
            with pytest.raises(EngineError) as info:  # outside a session: 0.5.23's refusal
                await client.update_weights_from_tensor([encode_safetensors_payload(bad)],
                                                        load_format=SAFETENSORS_LOAD_FORMAT)
            errors.append(info.value.message)
            await client.begin_weight_update()
            for payload, fmt in (
                ([encode_safetensors_payload(bad)], SAFETENSORS_LOAD_FORMAT),
                ([encode_safetensors_payload({"lm_head.weight": torch.zeros(3, 3)})], SAFETENSORS_LOAD_FORMAT),
                (["bm90IGEgcGF5bG9hZA=="], SAFETENSORS_LOAD_FORMAT),
                ([encode_safetensors_payload({"lm_head.weight": torch.zeros(320, 64)})], None),
            ):
                with pytest.raises(EngineError) as info:
                    await client.update_weights_from_tensor(payload, load_format=fmt, weight_version="9")
                errors.append(info.value.message)
            with pytest.raises(EngineError) as info:
                await client.begin_weight_update()
            errors.append(info.value.message)
            await client.end_weight_update()
            with pytest.raises(EngineError) as info:
                await client.end_weight_update()
            errors.append(info.value.message)
            after = await client.generate(PROMPT, GREEDY)
            return before, errors, after, await client.get_weight_version()

        before, errors, after, version = run(go())
    assert "must run between begin_weight_update() and end_weight_update()" in errors[0]
    errors = errors[1:]
    assert "unknown" in errors[0] and "shape" in errors[1] and "safetensors" in errors[2]
    assert "load_format='safetensors'" in errors[3]
    assert "already open" in errors[4] and "no weight-update session is open" in errors[5]
    assert after.output_ids == before.output_ids and version == "0"


def test_update_from_a_gloo_process_group(outputs_of_b):
    other = _tensors(tiny_checkpoint_other_seed())
    names = sorted(other)
    port = free_port()
    with cpu_engine() as server:

        async def go():
            client = EngineClient(server.url)
            holder: dict = {}
            trainer = threading.Thread(
                target=lambda: holder.update(group=create_weight_update_group("127.0.0.1", port, 0, 2, timeout_s=60))
            )
            trainer.start()  # rank 0 (the trainer) and the engine (rank_offset 1) join together
            await client.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo")
            trainer.join()
            await client.begin_weight_update()
            sender = threading.Thread(target=broadcast_tensors, args=(holder["group"], [other[n] for n in names]))
            sender.start()
            await client.update_weights_from_distributed(
                names,
                [dtype_name(other[n].dtype) for n in names],
                [list(other[n].shape) for n in names],
                weight_version="3",
            )
            sender.join()
            await client.end_weight_update()
            out = await client.generate(PROMPT, GREEDY)
            await client.destroy_weights_update_group()
            return out

        out = run(go())
    assert out.weight_version == "3" and out.output_ids == outputs_of_b


def test_update_mid_generation_splits_the_version_spans():
    other = _tensors(tiny_checkpoint_other_seed())
    with cpu_engine() as server:

        async def go():
            client = EngineClient(server.url)
            task = asyncio.create_task(
                client.generate(PROMPT, SamplingParams(max_new_tokens=600, ignore_eos=True), rid="long")
            )
            while (await client.get_server_info())["stats"]["generated_tokens"] < 20:
                await asyncio.sleep(0.01)
            await client.pause_generation(mode="in_place")  # the SGLang refit sequence
            await client.begin_weight_update()
            with pytest.raises(EngineError, match="cache was not flushed"):  # 0.5.23: flush needs idle
                await client.update_weights_from_tensor(
                    [encode_safetensors_payload(other)], load_format=SAFETENSORS_LOAD_FORMAT, weight_version="4")
            await client.update_weights_from_tensor(  # loaded either way; the pipeline never asks to flush here
                [encode_safetensors_payload(other)], load_format=SAFETENSORS_LOAD_FORMAT, weight_version="4",
                flush_cache=False)
            await client.end_weight_update()
            await client.continue_generation()
            return await asyncio.wait_for(task, 60)

        out = run(go())
    spans = [(s.version, s.start, s.end) for s in out.weight_version_spans]
    assert len(spans) == 2 and spans[0][0] == "0" and spans[1] == ("4", spans[0][2], 600)
    assert 0 < spans[0][2] < 600
    versions = out.token_versions()
    assert versions[: spans[0][2]] == ["0"] * spans[0][2] and set(versions[spans[0][2] :]) == {"4"}
    assert out.weight_version == "4"
