"""What each rank runs in the device-discipline test: a real SAO train step with the compute device
emulated apart from host memory (tests/emulated_device.py)."""

from __future__ import annotations

from typing import Any

from tests.training.trainer_worker import build_trainer
from tests.training.trajectories import random_trajectories

# Several micro-batches per rank, truncated rows bootstrapped and a clipped value loss: every
# branch of the step that builds tensors of its own.
STEP_OVERRIDES = ["parallelism.expert=2", "critic.updates_per_actor_step=2", "actor.max_tokens_per_micro_batch=96",
                  "critic.max_tokens_per_micro_batch=128", "algorithm.bootstrap_truncated=true",
                  "critic.value_clip=0.2"]


def step_on_emulated_device(hf_dir: str, overrides: list[str]) -> dict[str, Any]:
    """Build the actor and critic on the emulated compute device and take one step (K critic
    updates, one actor update); report what ran where."""
    from tests.emulated_device import emulated_compute_device, where

    with emulated_compute_device() as world:
        trainer = build_trainer(hf_dir, overrides)
        params = [p for role in trainer.roles.values() for chunk in role.chunks for p in chunk.parameters()]
        elsewhere = [name for role in trainer.roles.values() for chunk in role.chunks
                     for name, p in chunk.named_parameters() if where(p) is not False]
        metrics = trainer.train_step(random_trajectories(8, seed=3, long_every=8))
    return {"metrics": metrics, "collectives": world.collectives, "params": len(params),
            "params_not_on_device": elsewhere}


def other_modes_on_emulated_device(hf_dir: str, checkpoints: str) -> dict[str, Any]:
    """PP2 (the last stage's sums broadcast to the first): GRPO + PPO clip with recomputed old
    log-probs (trajectory-level advantages, made on the host), SFT, and the critic alone with the
    value-pretraining held-out evaluation and a checkpoint saved and loaded."""
    from pathlib import Path

    from megatron_sao.training.trainer import role_packing
    from megatron_sao.valuepretrain.evaluate import evaluate_heldout, return_range
    from tests.emulated_device import emulated_compute_device

    out: dict[str, Any] = {}
    pp2 = ["parallelism.pipeline=2"]
    with emulated_compute_device() as world:
        trajectories = random_trajectories(8, seed=11, group_size=2)
        rl = build_trainer(hf_dir, [*pp2, "algorithm.advantage=grpo", "algorithm.policy_loss=ppo_clip",
                                    "algorithm.group_size=2", "algorithm.old_logprobs=recompute"])
        out["grpo_ppo"] = rl.train_step(trajectories)
        out["sft"] = build_trainer(hf_dir, pp2, mode="sft").train_step(trajectories)
        critic = build_trainer(hf_dir, [*pp2, "critic.updates_per_actor_step=1"], mode="critic")
        out["critic"] = critic.train_step(trajectories)
        gamma = critic.config.algorithm.gamma
        heldout = evaluate_heldout(critic.critic, trajectories, role_packing(critic.config, "critic"), critic.dp_rank,
                                   critic.dp_size, gamma, return_range(trajectories, gamma), 4, 1)
        out["heldout_tokens"] = heldout.num_tokens
        saved = critic.save_checkpoint(Path(checkpoints), final=True)
        out["loaded_step"] = critic.load_checkpoint(saved)["trainer"]["step"]
        out["collectives"] = world.collectives
    return out
