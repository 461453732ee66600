"""Megatron DDP wrapping and the Megatron optimizer for one role, from its OptimizerConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_sao.config.schema import OptimizerConfig


@dataclass
class RoleOptimizer:
    """A role's DDP-wrapped chunks, its Megatron optimizer and LR scheduler."""

    chunks: list[Any]
    optimizer: Any
    scheduler: Any


def ddp_config_for(optim: OptimizerConfig) -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        bucket_size=None,
    )


def build_optimizer(chunks: list[Any], optim: OptimizerConfig, total_steps: int) -> RoleOptimizer:
    """Megatron optimizer (Adam, optionally sharded over DP) + LR schedule over `chunks`.

    `chunks` must already be wrapped in Megatron DDP (`ddp_config_for(optim)`), with frozen
    parameters' `requires_grad` cleared before wrapping.
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model_config = chunks[0].config
    megatron_cfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=model_config.bf16,
        fp16=model_config.fp16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(megatron_cfg, chunks)
    model_config.finalize_model_grads_func = finalize_model_grads
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    decay_steps = max(1, total_steps)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return RoleOptimizer(chunks=chunks, optimizer=optimizer, scheduler=scheduler)


def zero_grads(role: RoleOptimizer) -> None:
    for chunk in role.chunks:
        chunk.zero_grad_buffer()
    role.optimizer.zero_grad()


def optimizer_step(role: RoleOptimizer) -> tuple[bool, float | None]:
    """One optimizer step + LR schedule step; returns (applied, grad_norm)."""
    applied, grad_norm, _ = role.optimizer.step()
    if applied:
        role.scheduler.step(increment=1)
    return bool(applied), (float(grad_norm) if grad_norm is not None else None)

