"""Per-token log-probs and entropies from the actor's (vocab-parallel) logits.

The actor's GPTModel, called without labels, returns logits `[b, t, v]` where v is this
tensor-parallel rank's slice of the vocabulary. Both quantities below need the whole vocabulary,
so they reduce over the tensor-parallel group (Megatron's `vocab_parallel_cross_entropy` for the
log-prob, which carries gradient; three small all-reduces for the entropy, which does not).

Temperature: the rollout engine's log-probs are of `softmax(logits / T)` (docs/rollout.md), so
the trainer divides by the same T; DIS's ratio then compares like with like.

Alignment follows `models/outputs.py`: index t of the result belongs to token t and is read from
the logits at t - 1; index 0 (a prompt token) is 0.
"""

from __future__ import annotations

import torch

from megatron_sao.models.outputs import logprobs_from_token_loss


def _tp_group():
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


@torch.no_grad()
def vocab_parallel_entropy(logits_btv: torch.Tensor) -> torch.Tensor:
    """Entropy `[b, t]` of softmax(logits) at each position (the distribution of the NEXT token)."""
    group = _tp_group()
    logits = logits_btv.float()
    max_bt = logits.max(dim=-1).values
    if group is not None:
        torch.distributed.all_reduce(max_bt, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - max_bt.unsqueeze(-1)
    exp = shifted.exp()
    sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)])
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    sum_exp, sum_exp_logit = sums
    # H = log Z - E[l] with l the max-shifted logits (entropy is shift-invariant).
    return sum_exp.log() - sum_exp_logit / sum_exp


def token_logprobs_and_entropy(logits_btv: torch.Tensor, labels_bt: torch.Tensor,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logprobs_bt, entropy_bt)` aligned to tokens: logprobs carry gradient, entropy does not.

    `labels_bt` are `shifted_labels(input_ids)` (position t holds token t + 1).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled_btv = logits_btv.float() / temperature
    # Entropy first: Megatron's cross entropy works in place on its input to save memory.
    entropy_next_bt = vocab_parallel_entropy(scaled_btv)
    token_loss_bt = vocab_parallel_cross_entropy(scaled_btv, labels_bt, 0.0, _tp_group())
    entropy_bt = torch.zeros_like(entropy_next_bt)
    entropy_bt[:, 1:] = entropy_next_bt[:, :-1]
    return logprobs_from_token_loss(token_loss_bt), entropy_bt
