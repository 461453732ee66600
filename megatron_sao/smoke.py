"""The foundation smoke run: build the actor and critic of a recipe and take real optimizer steps.

Until the SAO trainer exists (trainer issue), `sao train` runs this on the recipe: it exercises
everything a run needs below the trainer (config, distributed init, Megatron models from the HF
checkpoint, parameter freezing, Megatron DDP + optimizer, pipeline schedule, wandb offline logging,
run directory) on synthetic token sequences with the real SAO losses from `megatron_sao.algo`:
targets from skip-observation GAE, K critic value-loss steps per actor step (after critic warmup
steps), and a DIS policy step against stand-in "rollout" log-probs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from megatron_sao.config.schema import SaoConfig

logger = logging.getLogger(__name__)

SEQ_LEN = 32


def _synthetic_batch(step: int, batch: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    from megatron_sao.models.outputs import causal_attention_mask, position_ids_for, shifted_labels

    g = torch.Generator().manual_seed(seed * 100_003 + step)
    ids = torch.randint(0, vocab, (batch, SEQ_LEN), generator=g)
    action_mask = torch.zeros(batch, SEQ_LEN, dtype=torch.bool)
    action_mask[:, SEQ_LEN // 4:] = True  # a prompt, then "actions"
    return {
        "input_ids": ids,
        "position_ids": position_ids_for(ids),
        "attention_mask": causal_attention_mask(SEQ_LEN),
        "labels": shifted_labels(ids),
        "loss_mask": action_mask,
        **_synthetic_targets(action_mask, g),
    }


def _synthetic_targets(loss_mask_bt: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Terminal reward +-1 and random "critic values", through SAO's skip-observation GAE with
    the length-adaptive policy lambda (value targets use lambda = 1)."""
    from megatron_sao.algo import length_adaptive_lambda, skip_observation_gae

    batch, seq = loss_mask_bt.shape
    rewards = torch.zeros(batch, seq)
    rewards[:, -1] = torch.randint(0, 2, (batch,), generator=g).float() * 2 - 1
    values = 0.1 * torch.randn(batch, seq, generator=g)
    lam = length_adaptive_lambda(loss_mask_bt.sum(-1))
    advantages, _ = skip_observation_gae(rewards, values, loss_mask_bt, lam=lam)
    _, returns = skip_observation_gae(rewards, values, loss_mask_bt, lam=1.0)
    return {"advantages": advantages.float(), "returns": returns.float()}


def smoke_rank(config: SaoConfig) -> list[dict[str, Any]]:
    """What each trainer rank runs. Returns the metrics history (identical on every rank)."""
    import torch.distributed as dist

    from megatron_sao.algo import dis_policy_loss, value_loss
    from megatron_sao.models import build_model
    from megatron_sao.models.outputs import logprobs_from_token_loss, values_from_head
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.training.forward_backward import run_forward_backward
    from megatron_sao.training.optim import build_optimizer, ddp_config_for, optimizer_step, zero_grads

    rank = dist.get_rank()
    init_model_parallel(config.parallelism, seed=config.run.seed)
    roles = {}
    for role in ("actor", "critic"):
        optim = getattr(config, role).optim
        built = build_model(config, role, wrap_with_ddp=True, ddp_config=ddp_config_for(optim))
        roles[role] = build_optimizer(built.chunks, optim, total_steps=config.run.total_steps)
    vocab = roles["actor"].chunks[0].module.vocab_size

    def actor_forward(model, b):
        return model(b["input_ids"], b["position_ids"], b["attention_mask"], labels=b["labels"])

    def critic_forward(model, b):
        return model(b["input_ids"], b["position_ids"], b["attention_mask"])

    alg = config.algorithm

    def critic_loss(output, b):
        # Megatron's per-token convention: return the token sum (num_tokens=1) and the count.
        loss, stats = value_loss(values_from_head(output), b["returns"], b["loss_mask"], num_tokens=1)
        count = b["loss_mask"].sum().to(torch.int)
        return loss, count, {"explained_variance": torch.tensor(stats["explained_variance"])}

    def actor_loss(output, b):
        # "Rollout" log-probs: the current ones, jittered, standing in for an engine's numbers.
        logp = logprobs_from_token_loss(output)
        rollout_logp = logp.detach() + 0.05 * torch.randn_like(logp)
        loss, stats = dis_policy_loss(logp, rollout_logp, b["advantages"], b["loss_mask"], alg.eps_low,
                                      alg.eps_high, num_tokens=1)
        return loss, b["loss_mask"].sum().to(torch.int), {"masked_frac": torch.tensor(stats["masked_frac"])}

    history = []
    micro = config.actor.micro_batch_size
    num_micro = max(1, config.data.batch_size // micro)
    for step in range(config.run.total_steps):
        t0 = time.perf_counter()
        batches = [_synthetic_batch(step * num_micro + i, micro, vocab, config.run.seed) for i in range(num_micro)]
        metrics: dict[str, float] = {"step": step}
        for k in range(config.critic.updates_per_actor_step):
            zero_grads(roles["critic"])
            out = run_forward_backward(roles["critic"].chunks, batches, critic_forward, critic_loss)
            _, metrics[f"critic/grad_norm_{k}"] = optimizer_step(roles["critic"])
            if out:
                metrics[f"critic/explained_variance_{k}"] = float(sum(o["explained_variance"] for o in out) / len(out))
        if step >= config.critic.warmup_steps:
            zero_grads(roles["actor"])
            out = run_forward_backward(roles["actor"].chunks, batches, actor_forward, actor_loss)
            _, metrics["actor/grad_norm"] = optimizer_step(roles["actor"])
            if out:
                metrics["actor/dis_masked_frac"] = float(sum(o["masked_frac"] for o in out) / len(out))
        metrics["step_time_s"] = time.perf_counter() - t0
        history.append(metrics)
        if rank == 0:
            logger.info("step %d %s", step, {k: round(v, 5) for k, v in metrics.items() if v is not None})
    return history


def run_smoke(config: SaoConfig, run_dir: Path) -> list[dict[str, Any]]:
    """Run the smoke job on `nproc_per_node` local processes (world_size from the config)."""
    from megatron_sao.config.validate import trainer_world_size
    from megatron_sao.models.build import check_layout_fits_model
    from megatron_sao.platform import run_distributed
    from megatron_sao.utils.run_logging import MetricsLogger

    if config.launcher.kind != "local" or config.launcher.nnodes != 1:
        raise NotImplementedError("multi-node / Slurm launch is the Slurm-launchers issue; "
                                  "set launcher.kind=local launcher.nnodes=1")
    check_layout_fits_model(config)  # also builds a tiny checkpoint once, before ranks race for it
    world = trainer_world_size(config)
    history = run_distributed(smoke_rank, world, config)[0]
    with MetricsLogger(config, run_dir) as metrics_logger:
        for metrics in history:
            metrics_logger.log(metrics, step=int(metrics["step"]))
    return history
