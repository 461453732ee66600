"""One optimizer update of a role on a list of micro-batches, and the losses it can take.

Every loss follows Megatron's per-token convention (training/forward_backward.py): it returns the
SUM of its token losses, the number of tokens, and a vector of named sums for the metrics, which
are added over micro-batches and data- and context-parallel ranks here (ratios of sums, never
means of means). Losses see `context_parallel.model_batch`es: this CP rank's positions, every
per-token input position-aligned (`label_*`: the entry of the token predicted at that position).

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
from megatron_sao.platform.context_parallel import cp_group, gather_sequence
from megatron_sao.platform.device import compute_device
from megatron_sao.training.batches import MicroBatch
from megatron_sao.training.context_parallel import model_batch
from megatron_sao.training.forward_backward import broadcast_from_last_stage, run_forward_backward
from megatron_sao.training.grad_norms import grad_sq_norms_by_group
from megatron_sao.training.logits import LabelOutputsRequest, label_outputs_processor
from megatron_sao.training.optim import RoleOptimizer, optimizer_step, zero_grads

LossFn = Callable[[Any, MicroBatch], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
ForwardFn = Callable[[torch.nn.Module, MicroBatch], Any]

POLICY_SUMS = ("loss", "tokens", "masked_low", "masked_high", "entropy", "kl_k3", "ratio", "clipped",
               "logprob_abs_diff")
VALUE_SUMS = ("loss", "tokens", "ev_n", "ev_r", "ev_r2", "ev_res", "ev_res2", "clipped")
SFT_SUMS = ("loss", "tokens", "entropy")


# ---- forward functions (one home: the trainer, tools and tests call these) -------------------

def model_forward(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Actor logits `[b, s, v/tp]` or critic head output `[b, s, 1]` (hidden states on an
    earlier pipeline stage). Causal by the layers' mask type: no attention mask tensor."""
    return model(batch["input_ids"], batch["position_ids"], None)


def label_outputs_forward(temperature: float = 1.0, chunk_tokens: int | None = None) -> ForwardFn:
    """The actor's `(logprobs_bs, entropy_bs)` per position (training/logits.py): logits computed
    `chunk_tokens` at a time inside the model's post-processing, never all at once."""

    def forward(model: torch.nn.Module, batch: MicroBatch) -> Any:
        request = LabelOutputsRequest(batch["labels"], temperature, chunk_tokens)
        return model(batch["input_ids"], batch["position_ids"], None, output_processor=label_outputs_processor,
                     output_processor_context=request)

    return forward


def token_loss_forward(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """The actor with Megatron's fused loss: `-log p(labels[t])` at each position t, `[b, s]`."""
    return model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"])


# ---- metric sums -----------------------------------------------------------------------------

def reduce_sums(outputs: Sequence[dict[str, torch.Tensor]], names: Sequence[str],
                replicated_over_cp: bool = False) -> dict[str, float]:
    """Add each micro-batch's `sums` over micro-batches and data- and context-parallel ranks;
    every rank of every pipeline stage gets the result (the loss lives on the last stage only).
    `replicated_over_cp`: the sums are of whole sequences, the same on every CP rank (counted once)."""
    from megatron.core import parallel_state

    total = None
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        total = torch.zeros(len(names), dtype=torch.float64, device=compute_device())
        for out in outputs:
            total += out["sums"].to(torch.float64)
        if replicated_over_cp and parallel_state.get_context_parallel_rank() != 0:
            total.zero_()
        torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    total = broadcast_from_last_stage(total, (len(names),), dtype=torch.float64)
    return dict(zip(names, total.tolist(), strict=True))


def _sums(values: Sequence[torch.Tensor | float], device: torch.device) -> torch.Tensor:
    """One float64 vector on `device` (the loss's) of tensors and Python numbers."""
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).detach().reshape(())
                        for v in values])


# ---- losses ----------------------------------------------------------------------------------

def policy_loss_fn(algorithm: AlgorithmConfig) -> LossFn:
    """DIS (against `rollout_logprobs`) or PPO clip (against `old_logprobs`) on `advantages`; the
    output is `label_outputs_forward`'s `(logprobs, entropy)`."""

    def loss_fn(outputs: tuple[torch.Tensor, torch.Tensor], mb: MicroBatch):
        logprobs_bs, entropy_bs = outputs
        mask_bs = mb["label_loss_mask"]
        if algorithm.policy_loss == "dis":
            loss, stats = dis_policy_loss(logprobs_bs, mb["label_rollout_logprobs"], mb["label_advantages"], mask_bs,
                                          algorithm.eps_low, algorithm.eps_high, num_tokens=1)
            low, high, clipped = stats["num_masked_low"], stats["num_masked_high"], 0.0
        else:
            loss, stats = ppo_clip_policy_loss(logprobs_bs, mb["label_old_logprobs"], mb["label_advantages"], mask_bs,
                                               algorithm.clip_low, algorithm.clip_high, num_tokens=1)
            low = high = 0.0
            clipped = stats["clip_frac"] * stats["num_action_tokens"]
        count = stats["num_action_tokens"]

        def total(mean: torch.Tensor) -> torch.Tensor:  # a mean back to a sum; 0 (not NaN) without tokens
            return torch.where(count > 0, mean * count, 0.0)

        # |trainer - engine| log-prob of each action token, before this update (what R3 replay shrinks).
        abs_diff = torch.where(mask_bs, (logprobs_bs.detach() - mb["label_rollout_logprobs"]).abs(), 0.0).sum()
        sums = _sums([loss, count, low, high, torch.where(mask_bs, entropy_bs, 0.0).sum(), total(stats["kl_k3"]),
                      total(stats["ratio_mean"]), clipped, abs_diff], loss.device)
        return loss, mask_bs.sum().to(torch.int), {"sums": sums}

    return loss_fn


def value_loss_fn(value_clip: float | None) -> LossFn:
    """The critic's (optionally clipped) squared error against `returns` on action tokens. The
    head at position t is V(state before token t + 1): position-aligned like the targets."""

    def loss_fn(head: torch.Tensor, mb: MicroBatch):
        values_bs = head[..., 0].float()
        mask_bs = mb["label_loss_mask"]
        loss, stats = value_loss(values_bs, mb["label_returns"], mask_bs, old_values=mb["label_old_values"],
                                 clip_range=value_clip, num_tokens=1)
        moments = explained_variance_moments(values_bs.detach(), mb["label_returns"], mask_bs)
        count = stats["num_action_tokens"]
        sums = torch.cat([_sums([loss, count], loss.device), moments, _sums([stats["clip_frac"] * count], loss.device)])
        return loss, mask_bs.sum().to(torch.int), {"sums": sums}

    return loss_fn


def sft_loss_fn() -> LossFn:
    """Cross-entropy of the action tokens (`loss_mask`): `-sum log p(token)`."""

    def loss_fn(outputs: tuple[torch.Tensor, torch.Tensor], mb: MicroBatch):
        logprobs_bs, entropy_bs = outputs
        mask_bs = mb["label_loss_mask"]
        loss = -torch.where(mask_bs, logprobs_bs, 0.0).sum()
        sums = _sums([loss, mask_bs.sum(), torch.where(mask_bs, entropy_bs, 0.0).sum()], loss.device)
        return loss, mask_bs.sum().to(torch.int), {"sums": sums}

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


def model_batches(micro_batches: Sequence[MicroBatch]) -> list[MicroBatch]:
    """This context-parallel rank's view of each micro-batch (`context_parallel.model_batch`)."""
    group = cp_group()
    return [model_batch(mb, group) for mb in micro_batches]


def guarded_update(role: RoleOptimizer, micro_batches: list[MicroBatch], loss_fn: LossFn, names: Sequence[str],
                   use_distributed_optimizer: bool, forward_fn: ForwardFn = model_forward) -> RoleUpdate:
    """Forward + backward over `micro_batches`, then one optimizer step unless anything is
    non-finite on any rank (see the module docstring)."""
    zero_grads(role)
    outputs = run_forward_backward(role.chunks, model_batches(micro_batches), forward_fn, loss_fn)
    sums = reduce_sums(outputs, names)
    group_sq = grad_sq_norms_by_group(role.chunks, role.optimizer, use_distributed_optimizer)
    if not (math.isfinite(sums["loss"]) and all(math.isfinite(v) for v in group_sq.values())):
        zero_grads(role)
        return RoleUpdate(False, None, sums, group_sq)
    applied, grad_norm = optimizer_step(role)
    return RoleUpdate(applied, grad_norm, sums, group_sq)


def forward_only(role: RoleOptimizer, micro_batches: list[MicroBatch],
                 output_fn: Callable[[Any, MicroBatch], Any], forward_fn: ForwardFn = model_forward) -> list[Any]:
    """`output_fn(output, model batch)` per micro-batch on the last pipeline stage (empty
    elsewhere), in eval mode and without autograd; outputs and model batches are this CP rank's."""
    for chunk in role.chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            return run_forward_backward(role.chunks, model_batches(micro_batches), forward_fn, forward_only=True,
                                        output_fn=output_fn)
    finally:
        for chunk in role.chunks:
            chunk.train()


def sequence_outputs(role: RoleOptimizer, micro_batches: list[MicroBatch],
                     output_fn: Callable[[Any, MicroBatch], torch.Tensor],
                     forward_fn: ForwardFn = model_forward) -> list[torch.Tensor]:
    """`forward_only` whose per-micro-batch `[b, s_local, ...]` result is gathered over the
    context-parallel group: whole sequences, position-aligned, on every CP rank of the last stage."""
    group = cp_group()
    return [gather_sequence(out, group) for out in forward_only(role, micro_batches, output_fn, forward_fn)]


def all_ranks_agree(flag: bool) -> bool:
    """True iff `flag` is True on every rank of the world."""
    value = torch.tensor([1.0 if flag else 0.0], device=compute_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return bool(value.item() == 1.0)
