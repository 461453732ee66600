"""What every trainer rank runs in the end-to-end weight sync test: a real actor optimizer step, then
a sync into a real CPU engine (served from trainer rank 0's process), then the engine's sampled
log-probs against the trainer's log-probs of the same tokens; once per mode."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import torch

PROMPT = list(range(10, 30))
NEW_TOKENS = 12


def trainer_logprobs(trainer, tokens: list[int]) -> list[float]:
    """Collective: the actor's log-prob of every token after the prompt, on every rank."""
    from megatron_sao.rollout.trajectory import FinishType, Trajectory
    from megatron_sao.training.batches import PackingConfig, build_micro_batch
    from megatron_sao.training.forward_backward import broadcast_from_last_stage
    from megatron_sao.training.logits import token_logprobs_and_entropy
    from megatron_sao.training.steps import forward_only

    traj = Trajectory(prompt_id="probe", trajectory_id="probe")
    traj.set_prompt(PROMPT)
    traj.append_action(tokens, [0.0] * len(tokens), [0] * len(tokens), FinishType.LENGTH)
    mb = build_micro_batch([traj], PackingConfig())
    out = forward_only(trainer.actor, [mb], lambda o, b: token_logprobs_and_entropy(o, b["labels"])[0])
    full = broadcast_from_last_stage(out[0] if out else None, tuple(mb["input_ids"].shape))
    # aligned to tokens: position t holds log p(token t | tokens < t)
    return full[0, len(PROMPT): len(PROMPT) + len(tokens)].tolist()


def _broadcast_list(values: list[int] | None) -> list[int]:
    box = [values]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def sync_and_compare(hf_dir: str, overrides: list[str], modes: list[str], work: str) -> dict[str, Any]:
    from megatron_sao.config.schema import WeightSyncConfig
    from megatron_sao.models.hf_export import HFWeightExporter
    from megatron_sao.pipeline.weight_sync import WeightSync, weights_checksum
    from megatron_sao.rollout.client import EngineClient, SamplingParams
    from tests.rollout.engine_helpers import cpu_engine
    from tests.training.trainer_worker import build_trainer
    from tests.training.trajectories import random_trajectories

    rank = torch.distributed.get_rank()
    trainer = build_trainer(hf_dir, ["algorithm.advantage=grpo", "algorithm.group_size=2", *overrides])
    exporter = HFWeightExporter(trainer.actor.chunks, hf_dir)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, sampling_seed=11, ignore_eos=True)
    results: dict[str, Any] = {}
    with cpu_engine(Path(hf_dir)) if rank == 0 else contextlib.nullcontext() as server:
        client = EngineClient(server.url) if server is not None else None

        def generate():
            return asyncio.run(client.generate(PROMPT, params)) if client is not None else None

        before = generate()
        for step, mode in enumerate(modes):
            metrics = trainer.train_step(random_trajectories(4, seed=step, group_size=2))
            version = trainer.state.actor_version
            config = WeightSyncConfig(mode=mode, bucket_mb=0.1, checksum=True)
            sync = WeightSync(exporter, config, disk_dir=f"{work}/disk")
            report = sync.sync(version, [client] if client is not None else [])
            out = generate()
            tokens = _broadcast_list(out.output_ids if out is not None else None)
            mine = trainer_logprobs(trainer, tokens)
            if rank == 0:
                views = server.engine.scheduler.weight_map.views
                results[mode] = {
                    "version": version, "engine_version": asyncio.run(client.get_weight_version()),
                    "answer_version": out.weight_version, "report": report,
                    "engine_checksum": weights_checksum({n: views[n] for n in report.digests}),
                    "engine_logprobs": out.output_logprobs, "trainer_logprobs": mine,
                    "changed_output": out.output_logprobs != before.output_logprobs,
                    "actor_loss": metrics.get("actor/loss"),
                }
                before = out
    return results

