"""What each rank runs in the trainer tests: build a `SaoTrainer` in a layout, take steps on
recorded-style trajectories, report metrics and (whole) parameters."""

from __future__ import annotations

from typing import Any

import torch

from tests.training.full_params import full_parameters
from tests.training.trajectories import random_trajectories

TIMING_PREFIXES = ("time/", "perf/")

# The single-process references of the layout tests (here so that the tests and the one process
# that computes them, tests/conftest.py `single_rank`, name the same values).
# test_trainer_layouts.py: token budgets small enough that the 8 trajectories span several
# micro-batches per rank. The LR is 1e-4 (paper: 1e-6 / 5e-6): Adam's first step moves an element
# by lr * g / (|g| + eps), whose sensitivity to g is ~lr / (4 eps) where |g| ~ eps, so the
# round-off that differs between layouts (~1e-10 on such near-zero gradients) moves parameters by
# ~lr * 2.5e3: 2.5e-6 at lr 1e-3.
LAYOUT_PACKING = ["actor.max_tokens_per_micro_batch=96", "critic.max_tokens_per_micro_batch=128",
                  "actor.optim.lr=1e-4", "critic.optim.lr=1e-4"]
# test_context_parallel.py: token budgets small enough that the batch spans several micro-batches
# of several rows (the long trajectory gets one of its own). lr 5e-5: Adam's first step moves an
# element by lr * g / (|g| + eps), ~lr / (4 eps) times as sensitive to g where |g| ~ eps (experts
# that get few tokens), so round-off that differs between layouts (~1e-10 there) moves such
# parameters by ~lr * 1e4 (measured at lr 1e-4 on this batch: TP2 alone 6e-7, CP2 x TP2 1.2e-6,
# both in expert fc1 weights); every parameter still moves by ~lr, 50x the 1e-6 tolerance.
CP_PACKING = ["actor.max_tokens_per_micro_batch=192", "critic.max_tokens_per_micro_batch=256",
              "actor.optim.lr=5e-5", "critic.optim.lr=5e-5"]



def make_config(hf_dir: str, overrides: list[str]):
    import torch.distributed as dist

    from megatron_sao.config import load_config

    return load_config(None, [
        f"model.hf_path={hf_dir}", "model.dtype=float32", f"parallelism.world_size={dist.get_world_size()}",
        "logging.param_table=false", "actor.optim.lr=1e-3", "critic.optim.lr=1e-3", "critic.warmup_steps=0",
        "run.total_steps=10", *overrides])


def build_trainer(hf_dir: str, overrides: list[str], mode: str = "rl"):
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.training.trainer import SaoTrainer

    config = make_config(hf_dir, overrides)
    init_model_parallel(config.parallelism, seed=config.run.seed)
    return SaoTrainer(config, mode=mode)


def local_params(role) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in role.chunks for n, p in c.named_parameters()}


def optimizer_tensors(role) -> dict[str, torch.Tensor]:
    """Every tensor of the role's inner torch optimizers' state (Adam moments, step)."""
    out = {}
    for i, sub in enumerate(getattr(role.optimizer, "chained_optimizers", [role.optimizer])):
        for j, state in enumerate(sub.optimizer.state.values()):
            for key, value in state.items():
                out[f"{i}.{j}.{key}"] = torch.as_tensor(value).detach().clone()
    return out


def one_step_in_layout(hf_dir: str, overrides: list[str]) -> dict[str, Any]:
    """One SAO step (K = 2, no warmup) on 8 mixed-length trajectories (one 4x longer)."""
    trainer = build_trainer(hf_dir, overrides)
    trajectories = random_trajectories(8, seed=3, long_every=8)
    metrics = trainer.train_step(trajectories)
    return {"metrics": metrics, "actor": full_parameters(trainer.actor.chunks),
            "critic": full_parameters(trainer.critic.chunks)}


def warmup_and_frozen(hf_dir: str) -> dict[str, Any]:
    """5 steps with critic warmup 2 and K = 2: what changes when."""
    trainer = build_trainer(hf_dir, ["critic.warmup_steps=2", "critic.updates_per_actor_step=2",
                                     "critic.frozen=[attention]", "run.total_steps=5"])
    trajectories = random_trajectories(6, seed=5)
    actor0, critic0 = local_params(trainer.actor), local_params(trainer.critic)
    history, actor_after = [], []
    for _ in range(5):
        history.append(trainer.train_step(trajectories))
        actor_after.append(local_params(trainer.actor))
    critic5 = local_params(trainer.critic)
    attention = [n for n in critic0 if ".self_attention." in n]
    return {
        "history": history,
        "actor_unchanged": [all(torch.equal(actor0[n], after[n]) for n in actor0) for after in actor_after],
        "critic_attention_unchanged": all(torch.equal(critic0[n], critic5[n]) for n in attention),
        "num_attention": len(attention),
        "critic_other_changed": any(not torch.equal(critic0[n], critic5[n]) for n in critic0 if n not in attention),
        "critic_schedule_steps": trainer.critic.scheduler.num_steps,
        "critic_decay_steps": trainer.critic.scheduler.lr_decay_steps,
        "actor_schedule_steps": trainer.actor.scheduler.num_steps,
        "state": trainer.state_dict(),
    }


def constant_return_steps(hf_dir: str) -> list[dict[str, float]]:
    """A step on a batch whose every return is 1.0, then one on a batch with spread returns."""
    trainer = build_trainer(hf_dir, ["critic.ev_min_return_var=1e-3"])
    flat = trainer.train_step(random_trajectories(6, seed=7, constant_reward=1.0))
    spread = trainer.train_step(random_trajectories(6, seed=8))
    return [flat, spread]


def inject_nan(hf_dir: str, role: str, nan_rank: int) -> dict[str, Any]:
    """A NaN in `role`'s forward output on rank `nan_rank` only, for the first step."""
    import torch.distributed as dist

    from megatron_sao.training.trainer import TrainingAborted

    trainer = build_trainer(hf_dir, ["run.max_consecutive_skipped_steps=2"])
    trajectories = random_trajectories(8, seed=9)
    target = getattr(trainer, role)
    poison = {"on": dist.get_rank() == nan_rank}

    def poisoned(module, inputs, out):  # the actor's output is `(logprobs, entropy)`, the critic's a tensor
        if not poison["on"]:
            return out
        return tuple(o * float("nan") for o in out) if isinstance(out, tuple) else out * float("nan")

    handles = [c.register_forward_hook(poisoned)
               for c in target.chunks]
    roles = {"actor": trainer.actor, "critic": trainer.critic}
    before = {r: (local_params(role), optimizer_tensors(role), role.scheduler.num_steps) for r, role in roles.items()}
    first = trainer.train_step(trajectories)
    unchanged = {}
    for r, role in roles.items():
        params, optim, sched = before[r]
        now_params, now_optim = local_params(role), optimizer_tensors(role)
        unchanged[r] = (all(torch.equal(params[n], now_params[n]) for n in params) and optim.keys() == now_optim.keys()
                        and all(torch.equal(optim[k], now_optim[k]) for k in optim)
                        and sched == role.scheduler.num_steps)
    poison["on"] = False
    second = trainer.train_step(trajectories)
    poison["on"] = dist.get_rank() == nan_rank
    trainer.train_step(trajectories)
    try:
        trainer.train_step(trajectories)
        aborted = ""
    except TrainingAborted as e:
        aborted = str(e)
    for handle in handles:
        handle.remove()
    return {"first": first, "second": second, "unchanged": unchanged, "aborted": aborted}


ABLATIONS: dict[str, list[str]] = {
    "grpo": ["algorithm.advantage=grpo", "algorithm.policy_loss=ppo_clip", "algorithm.group_size=2"],
    "grpo_dis": ["algorithm.advantage=grpo", "algorithm.policy_loss=dis", "algorithm.group_size=2"],
    "grpo_rollout_old_logprobs": ["algorithm.advantage=grpo", "algorithm.policy_loss=ppo_clip",
                                  "algorithm.group_size=2", "algorithm.old_logprobs=rollout"],
    "sao_k1": ["critic.updates_per_actor_step=1"],
    "full_parameter_critic": ["critic.frozen=[]"],
    "step_level": ["algorithm.advantage=step_level"],
    "step_level_last": ["algorithm.advantage=step_level", "algorithm.step_level_mode=last"],
    "running_mean": ["algorithm.advantage=running_mean"],
    "mini_batches": ["actor.num_mini_batches=2"],
    "bootstrap_truncated_value_clip": ["algorithm.bootstrap_truncated=true", "critic.value_clip=0.2"],
}


def ablation_steps(hf_dir: str) -> dict[str, Any]:
    """Every ablation takes one real step; report what it built and did."""
    out = {}
    trajectories = random_trajectories(8, seed=11, group_size=2)
    for name, overrides in ABLATIONS.items():
        trainer = build_trainer(hf_dir, overrides)
        actor0 = local_params(trainer.actor)
        metrics = trainer.train_step(trajectories)
        out[name] = {
            "metrics": metrics,
            "has_critic": trainer.critic is not None,
            "actor_changed": any(not torch.equal(actor0[n], p) for n, p in local_params(trainer.actor).items()),
            "actor_optimizer_steps": trainer.state.actor_optimizer_steps,
            "state": trainer.state_dict(),
        }
    return out


def sft_steps(hf_dir: str, num_steps: int = 6) -> list[float]:
    trainer = build_trainer(hf_dir, [], mode="sft")
    assert trainer.critic is None
    trajectories = random_trajectories(6, seed=13)
    return [trainer.train_step(trajectories)["actor/loss"] for _ in range(num_steps)]


def critic_only_steps(hf_dir: str) -> dict[str, Any]:
    """mode="critic" (value pretraining): no actor built, the value loss falls on a fixed batch."""
    trainer = build_trainer(hf_dir, ["critic.updates_per_actor_step=1"], mode="critic")
    trajectories = random_trajectories(6, seed=17)
    history = [trainer.train_step(trajectories) for _ in range(4)]
    return {"history": history, "roles": sorted(trainer.roles), "has_actor": trainer.actor is not None}


def packed_cp_trajectories(seed: int = 3):
    """8 mixed-length trajectories, the last 8x longer than the others' typical length."""
    return random_trajectories(8, seed=seed, long_every=8, long_factor=8)


def rl_and_sft_step(hf_dir: str, overrides: list[str], with_sft: bool = True) -> dict[str, Any]:
    """One SAO step (K = 2) and, with `with_sft`, one SFT step (fresh trainers), on the packed
    trajectories: metrics and whole parameters after each."""
    trainer = build_trainer(hf_dir, overrides)
    metrics = trainer.train_step(packed_cp_trajectories())
    out = {"rl": {"metrics": metrics, "actor": full_parameters(trainer.actor.chunks),
                  "critic": full_parameters(trainer.critic.chunks)}}
    if with_sft:
        sft = build_trainer(hf_dir, overrides, mode="sft")
        metrics = sft.train_step(packed_cp_trajectories())
        out["sft"] = {"metrics": metrics, "actor": full_parameters(sft.actor.chunks)}
    return out


def steps_across_checkpoint(hf_dir: str, overrides: list[str], first_step: int, num_steps: int,
                            save_dir: str = "", load_dir: str = "") -> dict[str, Any]:
    """Steps first_step + 1 .. first_step + num_steps (batch i: seed 30 + i), after loading
    `load_dir` (an iter directory) if given, then a checkpoint into `save_dir` if given."""
    from pathlib import Path

    trainer = build_trainer(hf_dir, overrides)
    if load_dir:
        trainer.load_checkpoint(Path(load_dir))
    history = [trainer.train_step(packed_cp_trajectories(seed=30 + i))
               for i in range(first_step + 1, first_step + num_steps + 1)]
    saved = str(trainer.save_checkpoint(Path(save_dir), final=True)) if save_dir else ""
    return {"history": history, "saved": saved, "actor": full_parameters(trainer.actor.chunks),
            "critic": full_parameters(trainer.critic.chunks)}
