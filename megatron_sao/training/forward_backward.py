"""Run forward (and backward) over micro-batches with Megatron's pipeline schedules.

The same call serves every layout: without pipeline parallelism Megatron's schedule is a plain
loop over micro-batches; with it (and virtual stages) it is 1F1B / interleaved, activations
travelling between stages. Loss functions follow Megatron's per-token convention
(`calculate_per_token_loss`): they return (sum of token losses, number of tokens, metrics) and
Megatron divides gradients by the token count summed over micro-batches and data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_sao.platform.device import compute_device

Batch = dict[str, torch.Tensor]
ForwardFn = Callable[[torch.nn.Module, Batch], torch.Tensor]
LossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def run_forward_backward(
    chunks: list[torch.nn.Module],
    micro_batches: list[Batch],
    forward_fn: ForwardFn,
    loss_fn: LossFn | None = None,
    forward_only: bool = False,
    output_fn: Callable[[torch.Tensor, Batch], Any] | None = None,
) -> list[Any]:
    """Run the schedule; returns, on the last pipeline stage, per micro-batch: the metrics dict of
    `loss_fn`, or (when `loss_fn` is None, forward only) the model output passed through
    `output_fn(output, micro_batch)` (the raw output without it). Empty elsewhere.

    Micro-batches may differ in shape when the model config has `variable_seq_lengths` (set by
    `models.build` under pipeline parallelism: stages then exchange shapes before activations)
    or without pipeline parallelism; otherwise they must share one `[b, t]` shape. Under context
    parallelism they hold this rank's share of each sequence (`context_parallel.model_batch`).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("run_forward_backward needs at least one micro-batch")
    if loss_fn is None and not forward_only:
        raise ValueError("a backward pass needs a loss_fn")
    micro_batch_size, seq_length = micro_batches[0]["input_ids"].shape
    config = chunks[0].config
    shapes_may_vary = config.variable_seq_lengths or config.pipeline_model_parallel_size == 1
    for i, mb in enumerate(micro_batches):
        if not shapes_may_vary and tuple(mb["input_ids"].shape) != (micro_batch_size, seq_length):
            raise ValueError(f"micro-batch {i} has input_ids shape {tuple(mb['input_ids'].shape)}, "
                             f"expected {(micro_batch_size, seq_length)} like micro-batch 0")
    if loss_fn is not None and not config.calculate_per_token_loss:
        raise ValueError("models must be built with calculate_per_token_loss=True (models.build does this): "
                         "loss functions here return token sums")

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = forward_fn(model, batch)
        if loss_fn is None:
            if isinstance(output, tuple):
                # A tuple (the actor's `(logprobs, entropy)` from `label_outputs_processor`) travels
                # as a dict: the schedule reads the output's device for MoE's aux-loss scale, which
                # `get_tensor_device` finds for a tensor or a dict only (megatron-core 0.19.2
                # pipeline_parallel/schedules.py forward_step_calc_loss).
                output = {str(i): part for i, part in enumerate(output)}
                unpack = lambda out: tuple(out[str(i)] for i in range(len(out)))  # noqa: E731
            else:
                unpack = lambda out: out  # noqa: E731
            if output_fn is None:
                return output, lambda out, non_loss_data=False: unpack(out)
            return output, lambda out, non_loss_data=False: output_fn(unpack(out), batch)
        return output, lambda out: loss_fn(out, batch)

    # One iterator per model chunk: each virtual stage consumes every micro-batch once.
    iterators = [iter(micro_batches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=len(micro_batches),
        # The schedule takes the whole sequence length and divides it by CP itself
        # (schedules.get_tensor_shapes).
        seq_length=seq_length * parallel_state.get_context_parallel_world_size(),
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        collect_non_loss_data=loss_fn is None,
    )


def broadcast_from_last_stage(tensor: torch.Tensor | None, shape: tuple[int, ...],
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Give every pipeline stage the last stage's `tensor` (others pass None and its shape)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        assert tensor is not None
        return tensor
    group = parallel_state.get_pipeline_model_parallel_group()
    last = torch.distributed.get_global_rank(group, parallel_state.get_pipeline_model_parallel_world_size() - 1)
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=compute_device())
    tensor = tensor.contiguous()
    torch.distributed.broadcast(tensor, last, group=group)
    return tensor
