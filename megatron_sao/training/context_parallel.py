"""What one context-parallel rank feeds its model: the micro-batch cut to its sequence chunks, in
Megatron's next-token alignment.

A `MicroBatch` (training/batches.py) holds whole trajectories, token-aligned: index t of every
per-token tensor belongs to token t (the rollout record's convention, which GAE and the advantage
code use). The model and the losses work per POSITION: position t predicts `labels[t]` = token
t + 1 from tokens 0..t. `model_batch` builds what the schedule consumes:
  - `input_ids`, `position_ids`, `labels` (Megatron's convention), `token_mask` (real input tokens);
  - `label_<key>` for each per-token training tensor: the entry of the token at position t + 1,
    so the log-prob, value, mask and targets of one prediction sit at the same index and a loss is
    a sum over local positions (`label_loss_mask` marks the positions whose label is an action);
  - `routed_experts` (routing replay) as it is: it is per input position, and rank 0 already cut
    it to this rank's chunks (training/routing_shards.py);
and, under context parallelism (CP > 1), cuts every one of them to this rank's two chunks of the
sequence with Megatron-Core's own `get_batch_on_this_cp_rank` (2 x CP equal chunks, rank r holding
chunks r and 2 CP - 1 - r: each rank gets the same causal-attention work). The rotary embeddings
are cut the same way inside the model (`RotaryEmbedding.forward`).

A loss over local positions is a partial sum: Megatron adds the token counts over the data- and
context-parallel group (`finalize_model_grads`, `calculate_per_token_loss`) and the gradients of
the replicated parameters over the same group (DDP), so the step equals the CP = 1 step. Metric
sums are added over that group too (`steps.reduce_sums`).

`gather_sequence` (platform/context_parallel.py, with `split_sequence`) is the inverse cut, for
outputs that whole-trajectory computations need (the critic's values for GAE, recomputed log-
probs): all-gathered over the CP group, back in sequence order. Values are one float per token, so
every CP rank gathers all of them and runs GAE on the whole trajectory (O(T) floats per rank,
nothing next to the activations): exchanging only the values at action/observation boundaries would
save those few bytes at the price of a recursion carried rank to rank. """

from __future__ import annotations

import torch

from megatron_sao.platform.context_parallel import split_sequence

MicroBatch = dict[str, torch.Tensor]

LABEL_ALIGNED = ("loss_mask", "rollout_logprobs", "advantages", "old_logprobs", "returns", "old_values")
"""Token-aligned micro-batch keys the losses read, realigned as `label_<key>`."""


def label_positions(token_aligned_bt: torch.Tensor) -> torch.Tensor:
    """`[b, t]` token-aligned -> position-aligned: index t holds the entry of token t + 1 (the
    label predicted there); the last position predicts nothing (zero / False)."""
    out = torch.zeros_like(token_aligned_bt)
    out[:, :-1] = token_aligned_bt[:, 1:]
    return out


def token_positions(label_aligned_bt: torch.Tensor) -> torch.Tensor:
    """Inverse of `label_positions`: index t holds the entry predicted at t - 1; token 0 (a prompt
    token, never predicted) is zero."""
    out = torch.zeros_like(label_aligned_bt)
    out[:, 1:] = label_aligned_bt[:, :-1]
    return out


def model_batch(mb: MicroBatch, group=None) -> MicroBatch:
    """What the model and the losses see of `mb` on this CP rank (see the module docstring)."""
    full = {key: mb[key] for key in ("input_ids", "position_ids", "labels", "token_mask")}
    for key in LABEL_ALIGNED:
        if key in mb:
            full[f"label_{key}"] = label_positions(mb[key])
    local = split_sequence(full, group)
    if "routed_experts" in mb:  # routing replay: rank 0 already sent this rank its own positions (routing_shards.py)
        local["routed_experts"] = mb["routed_experts"]
    return local
