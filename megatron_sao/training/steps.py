"""One optimizer update of a role on a list of micro-batches, and the losses it can take.

Every loss follows Megatron's per-token convention (training/forward_backward.py): it returns the
SUM of its token losses, the number of tokens, and a vector of named sums for the metrics, which
are added over micro-batches and data-parallel ranks here (ratios of sums, never means of means).

Numerical safety: after the backward, the loss sum and the gradient's squared norms (per
parameter group, reduced over the world) are the same number on every rank; if any is not
finite the update is skipped on all ranks alike: gradients are zeroed, no optimizer or schedule
step is taken, so no parameter and no optimizer state changes anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_sao.algo import dis_policy_loss, explained_variance_moments, ppo_clip_policy_loss, value_loss
from megatron_sao.config.schema import AlgorithmConfig
from megatron_sao.models.outputs import values_from_head
from megatron_sao.platform.device import compute_device
from megatron_sao.training.batches import MicroBatch
from megatron_sao.training.forward_backward import broadcast_from_last_stage, run_forward_backward
from megatron_sao.training.grad_norms import grad_sq_norms_by_group
from megatron_sao.training.logits import token_logprobs_and_entropy
from megatron_sao.training.optim import RoleOptimizer, optimizer_step, zero_grads

LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]

POLICY_SUMS = ("loss", "tokens", "masked_low", "masked_high", "entropy", "kl_k3", "ratio", "clipped",
               "logprob_abs_diff")
VALUE_SUMS = ("loss", "tokens", "ev_n", "ev_r", "ev_r2", "ev_res", "ev_res2", "clipped")
SFT_SUMS = ("loss", "tokens", "entropy")


# ---- forward functions (one home: the trainer, tools and tests call these) -------------------

def model_forward(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Actor logits `[b, t, v/tp]` or critic head output `[b, t, 1]` (hidden states on an
    earlier pipeline stage)."""
    return model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])


def token_loss_forward(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """The actor with Megatron's fused loss: `-log p(token t+1)` at each position t, `[b, t]`."""
    return model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])


# ---- metric sums -----------------------------------------------------------------------------

def reduce_sums(outputs: Sequence[dict[str, torch.Tensor]], names: Sequence[str]) -> dict[str, float]:
    """Add each micro-batch's `sums` over micro-batches and data-parallel ranks; every rank of
    every pipeline stage gets the result (the loss lives on the last stage only)."""
    from megatron.core import parallel_state

    total = None
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        total = torch.zeros(len(names), dtype=torch.float64, device=compute_device())
        for out in outputs:
            total += out["sums"].to(torch.float64)
        torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    total = broadcast_from_last_stage(total, (len(names),), dtype=torch.float64)
    return dict(zip(names, total.tolist(), strict=True))


def _sums(values: Sequence[torch.Tensor | float], device: torch.device) -> torch.Tensor:
    """One float64 vector on `device` (the loss's) of tensors and Python numbers."""
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).detach().reshape(())
                        for v in values])


# ---- losses ----------------------------------------------------------------------------------

def policy_loss_fn(algorithm: AlgorithmConfig, temperature: float) -> LossFn:
    """DIS (against `rollout_logprobs`) or PPO clip (against `old_logprobs`) on `advantages`."""

    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        logprobs_bt, entropy_bt = token_logprobs_and_entropy(logits, mb["labels"], temperature)
        mask_bt = mb["loss_mask"]
        if algorithm.policy_loss == "dis":
            loss, stats = dis_policy_loss(logprobs_bt, mb["rollout_logprobs"], mb["advantages"], mask_bt,
                                          algorithm.eps_low, algorithm.eps_high, num_tokens=1)
            low, high, clipped = stats["num_masked_low"], stats["num_masked_high"], 0.0
        else:
            loss, stats = ppo_clip_policy_loss(logprobs_bt, mb["old_logprobs"], mb["advantages"], mask_bt,
                                               algorithm.clip_low, algorithm.clip_high, num_tokens=1)
            low = high = 0.0
            clipped = stats["clip_frac"] * stats["num_action_tokens"]
        count = stats["num_action_tokens"]

        def total(mean: torch.Tensor) -> torch.Tensor:  # a mean back to a sum; 0 (not NaN) without tokens
            return torch.where(count > 0, mean * count, 0.0)

        # |trainer - engine| log-prob of each action token, before this update (what R3 replay shrinks).
        abs_diff = torch.where(mask_bt, (logprobs_bt.detach() - mb["rollout_logprobs"]).abs(), 0.0).sum()
        sums = _sums([loss, count, low, high, torch.where(mask_bt, entropy_bt, 0.0).sum(), total(stats["kl_k3"]),
                      total(stats["ratio_mean"]), clipped, abs_diff], loss.device)
        return loss, mask_bt.sum().to(torch.int), {"sums": sums}

    return loss_fn


def value_loss_fn(value_clip: float | None) -> LossFn:
    """The critic's (optionally clipped) squared error against `returns` on action tokens."""

    def loss_fn(head: torch.Tensor, mb: MicroBatch):
        values_bt = values_from_head(head)
        mask_bt = mb["loss_mask"]
        loss, stats = value_loss(values_bt, mb["returns"], mask_bt, old_values=mb["old_values"],
                                 clip_range=value_clip, num_tokens=1)
        moments = explained_variance_moments(values_bt.detach(), mb["returns"], mask_bt)
        count = stats["num_action_tokens"]
        sums = torch.cat([_sums([loss, count], loss.device), moments, _sums([stats["clip_frac"] * count], loss.device)])
        return loss, mask_bt.sum().to(torch.int), {"sums": sums}

    return loss_fn


def sft_loss_fn() -> LossFn:
    """Cross-entropy of the action tokens (`loss_mask`): `-sum log p(token)`."""

    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        logprobs_bt, entropy_bt = token_logprobs_and_entropy(logits, mb["labels"])
        mask_bt = mb["loss_mask"]
        loss = -torch.where(mask_bt, logprobs_bt, 0.0).sum()
        sums = _sums([loss, mask_bt.sum(), torch.where(mask_bt, entropy_bt, 0.0).sum()], loss.device)
        return loss, mask_bt.sum().to(torch.int), {"sums": sums}

    return loss_fn


# ---- one update --------------------------------------------------------------------------------

@dataclass
class RoleUpdate:
    """What one guarded optimizer update did."""

    applied: bool
    grad_norm: float | None
    sums: dict[str, float]
    group_sq_norms: dict[str, float] = field(default_factory=dict)

    @property
    def group_norms(self) -> dict[str, float]:
        return {group: math.sqrt(sq) if math.isfinite(sq) else sq for group, sq in self.group_sq_norms.items()}


def guarded_update(role: RoleOptimizer, micro_batches: list[MicroBatch], loss_fn: LossFn, names: Sequence[str],
                   use_distributed_optimizer: bool, forward_fn: Callable[..., Any] = model_forward) -> RoleUpdate:
    """Forward + backward over `micro_batches`, then one optimizer step unless anything is
    non-finite on any rank (see the module docstring)."""
    zero_grads(role)
    outputs = run_forward_backward(role.chunks, micro_batches, forward_fn, loss_fn)
    sums = reduce_sums(outputs, names)
    group_sq = grad_sq_norms_by_group(role.chunks, role.optimizer, use_distributed_optimizer)
    if not (math.isfinite(sums["loss"]) and all(math.isfinite(v) for v in group_sq.values())):
        zero_grads(role)
        return RoleUpdate(False, None, sums, group_sq)
    applied, grad_norm = optimizer_step(role)
    return RoleUpdate(applied, grad_norm, sums, group_sq)


def forward_only(role: RoleOptimizer, micro_batches: list[MicroBatch],
                 output_fn: Callable[[torch.Tensor, MicroBatch], Any],
                 forward_fn: Callable[..., Any] = model_forward) -> list[Any]:
    """`output_fn(output, micro_batch)` per micro-batch on the last pipeline stage (empty elsewhere),
    in eval mode and without autograd."""
    for chunk in role.chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            return run_forward_backward(role.chunks, micro_batches, forward_fn, forward_only=True,
                                        output_fn=output_fn)
    finally:
        for chunk in role.chunks:
            chunk.train()


def all_ranks_agree(flag: bool) -> bool:
    """True iff `flag` is True on every rank of the world."""
    value = torch.tensor([1.0 if flag else 0.0], device=compute_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return bool(value.item() == 1.0)
