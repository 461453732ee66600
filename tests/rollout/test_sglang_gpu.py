"""The real SGLang path on a GPU: launch through EngineSupervisor, generate token-in / token-out
with log-probs through EngineClient, refit from disk. Skipped on CPU machines."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_sao.rollout.client import EngineClient, SamplingParams
from megatron_sao.rollout.engine_supervisor import EngineConfig, EngineSupervisor
from tests.rollout.engine_helpers import tiny_checkpoint, tiny_checkpoint_other_seed


@pytest.mark.gpu
def test_sglang_generates_with_logprobs_and_refits_from_disk(tmp_path):
    pytest.importorskip("sglang", reason="the GPU test needs sglang (requirements-gpu.txt)")
    config = EngineConfig(
        backend="sglang",
        model_path=str(tiny_checkpoint()),
        mem_fraction_static=0.3,
        log_dir=str(tmp_path),
        extra_args=["--dtype", "float32", "--attention-backend", "triton", "--disable-cuda-graph"],
    )
    prompt = list(range(10, 40))
    params = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)
    with EngineSupervisor(config) as launcher:
        client = EngineClient(launcher.urls[0])

        async def go():
            out = await client.generate(prompt, params)
            await client.update_weights_from_disk(str(tiny_checkpoint_other_seed()), weight_version="1")
            return (
                out,
                await client.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0.0)),
                (await client.get_weight_version()),
            )

        out, after, version = asyncio.run(go())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), dtype=torch.float32)
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + out.output_ids])).logits[0].float(), -1)
    expected = [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(out.output_ids)]
    assert out.weight_version == "0" and len(out.output_ids) == 16
    assert max(abs(a - b) for a, b in zip(out.output_logprobs, expected, strict=True)) < 1e-3
    assert version == "1" and after.weight_version == "1"
