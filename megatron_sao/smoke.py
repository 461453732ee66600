"""The foundation smoke run: build the actor and critic of a recipe and take real optimizer steps.

Until the SAO trainer exists (trainer issue), `sao train` runs this on the recipe: it exercises
everything a run needs below the trainer (config, distributed init, Megatron models from the HF
checkpoint, parameter freezing, Megatron DDP + optimizer, pipeline schedule, wandb offline logging,
run directory) on synthetic token sequences, with SAO-shaped losses: K critic regression steps
per actor step and a DIS-style policy-gradient step against detached "rollout" log-probs.
"""

from __future__ import annotations

import json
import logging
import os
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
        "returns": torch.randn(batch, SEQ_LEN, generator=g).clamp(-1, 1),
        "advantages": torch.randn(batch, SEQ_LEN, generator=g),
    }


def smoke_rank(config: SaoConfig, run_dir: str) -> dict[str, Any]:
    """What each trainer rank runs. Returns the metrics history (identical on every rank)."""
    import torch.distributed as dist

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

    def critic_loss(output, b):
        mask = b["loss_mask"]
        sq = ((values_from_head(output) - b["returns"]) ** 2)[mask]
        return sq.sum() / 2, mask.sum().to(torch.int), {"value_loss_sum": sq.sum().detach()}

    def actor_loss(output, b):
        # DIS-shaped: detached ratio to the "rollout" log-probs (here: the current ones, jittered),
        # tokens outside the band dropped, policy gradient weighted by the advantage.
        mask = b["loss_mask"]
        logp = logprobs_from_token_loss(output)
        rollout_logp = logp.detach() + 0.05 * torch.randn_like(logp)
        rho = torch.exp(logp.detach() - rollout_logp)
        alg = config.algorithm
        kept = mask & (rho > 1 - alg.eps_low) & (rho < 1 + alg.eps_high)
        loss = -(kept * rho * b["advantages"] * logp).sum()
        return loss, mask.sum().to(torch.int), {"kept_tokens": kept.sum().float(), "tokens": mask.sum().float()}

    history = []
    micro = config.actor.micro_batch_size
    num_micro = max(1, config.data.batch_size // micro)
    for step in range(config.run.total_steps):
        t0 = time.perf_counter()
        batches = [_synthetic_batch(step * num_micro + i, micro, vocab, config.run.seed) for i in range(num_micro)]
        metrics: dict[str, float] = {"step": step}
        for k in range(config.critic.updates_per_actor_step):
            zero_grads(roles["critic"])
            run_forward_backward(roles["critic"].chunks, batches, critic_forward, critic_loss)
            _, metrics[f"critic/grad_norm_{k}"] = optimizer_step(roles["critic"])
        if step >= config.critic.warmup_steps:
            zero_grads(roles["actor"])
            out = run_forward_backward(roles["actor"].chunks, batches, actor_forward, actor_loss)
            _, metrics["actor/grad_norm"] = optimizer_step(roles["actor"])
            if out:
                metrics["actor/kept_frac"] = float(sum(o["kept_tokens"] for o in out) / sum(o["tokens"] for o in out))
        metrics["step_time_s"] = time.perf_counter() - t0
        history.append(metrics)
        if rank == 0:
            logger.info("step %d %s", step, {k: round(v, 5) for k, v in metrics.items() if v is not None})
    return {"history": history}


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
    results = run_distributed(smoke_rank, world, config, str(run_dir))
    history = results[0]["history"]
    with MetricsLogger(config, run_dir) as metrics_logger:
        for metrics in history:
            metrics_logger.log(metrics, step=int(metrics["step"]))
    (run_dir / "smoke_summary.json").write_text(json.dumps({"world_size": world, "history": history,
                                                            "pid": os.getpid()}, indent=1))
    return history
