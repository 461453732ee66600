"""Per-position log-probs and entropies from the actor's (vocab-parallel) logits, in sequence chunks.

Both quantities need the whole vocabulary, so they reduce over the tensor-parallel group
(Megatron's `vocab_parallel_cross_entropy` for the log-prob, which carries gradient; three small
all-reduces for the entropy, which does not).

Memory: the actor's logits are `tokens x vocab / TP`, and an fp32 copy of them (plus the softmax
the cross entropy keeps for its backward) is the largest activation of a long trajectory.
`label_outputs_processor` is handed to Megatron's GPTModel as its `output_processor` (the model's
post-processing hook, `gpt_model.py _postprocess`): it receives the final hidden states instead of
logits and runs the output layer on `chunk_tokens` tokens at a time, each chunk under activation
checkpointing, so only one chunk's logits (and their fp32 softmax) exist at any moment, in the
forward and again when the backward recomputes them (`actor.logits_chunk_tokens`; None: one chunk).
The results are those of the whole-logits computation, token for token.

Temperature: the rollout engine's log-probs are of `softmax(logits / T)` (docs/rollout.md), so
the trainer divides by the same T; DIS's ratio then compares like with like.

Alignment: per POSITION (Megatron's convention, training/context_parallel.py): index t of the
result is `log p(labels[t])`, labels[t] being token t + 1, and the entropy of the distribution at
t. `token_logprobs_and_entropy` realigns to tokens for callers that hold whole logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from megatron_sao.training.context_parallel import token_positions


def _tp_group():
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


@torch.no_grad()
def vocab_parallel_entropy(logits_btv: torch.Tensor) -> torch.Tensor:
    """Entropy `[..]` of softmax(logits) at each position (the distribution of the NEXT token)."""
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


def _logprob_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                         with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(log p(label), entropy or None)` per position of `logits [..., v/tp]`."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / temperature
    # Entropy first: Megatron's cross entropy works in place on its input to save memory.
    entropy = vocab_parallel_entropy(scaled) if with_entropy else None
    return -vocab_parallel_cross_entropy(scaled, labels, 0.0, _tp_group()), entropy


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def label_logprobs_and_entropy(logits_btv: torch.Tensor, labels_bt: torch.Tensor,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logprobs_bt, entropy_bt)` per position from whole logits: logprobs carry gradient."""
    _check_temperature(temperature)
    logprobs, entropy = _logprob_and_entropy(logits_btv, labels_bt, temperature, with_entropy=True)
    return logprobs, entropy


def token_logprobs_and_entropy(logits_btv: torch.Tensor, labels_bt: torch.Tensor,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logprobs_bt, entropy_bt)` aligned to TOKENS (index t: log pi(token t | tokens < t), read
    at position t - 1; 0 at t = 0), from whole logits of whole sequences (CP = 1).

    `labels_bt` are `shifted_labels(input_ids)` (position t holds token t + 1).
    """
    logprobs, entropy = label_logprobs_and_entropy(logits_btv, labels_bt, temperature)
    return token_positions(logprobs), token_positions(entropy)


@dataclass(frozen=True, slots=True)
class LabelOutputsRequest:
    """The `output_processor_context` of `label_outputs_processor`."""

    labels_bt: torch.Tensor
    """`[b, s]` labels of this rank's positions (position-aligned, CP-local)."""
    temperature: float = 1.0
    chunk_tokens: int | None = None
    """Tokens (rows x positions) whose logits are computed at once; None: all of them."""


def label_outputs_processor(hidden_states: torch.Tensor, output_layer: torch.nn.Module,
                            output_weight: torch.Tensor | None, context: LabelOutputsRequest,
                            **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTModel `output_processor`: `(logprobs_bt, entropy_bt)` per position, logits in chunks.

    `hidden_states` are `[s, b, h]`, or this TP rank's `[s / tp, b, h]` slice under sequence
    parallelism, where the output layer all-gathers each chunk over TP: a chunk of the local
    slice is then the same rows of every TP rank's slice, and its labels and results are indexed
    accordingly.
    """
    from megatron.core import parallel_state

    _check_temperature(context.temperature)
    local_len, batch, _ = hidden_states.shape
    tp = parallel_state.get_tensor_model_parallel_world_size() if output_layer.sequence_parallel else 1
    labels_sb = context.labels_bt.transpose(0, 1)
    if labels_sb.shape[0] != local_len * tp:
        raise ValueError(f"labels cover {labels_sb.shape[0]} positions, the hidden states {local_len * tp}")
    rows = local_len if context.chunk_tokens is None else max(1, context.chunk_tokens // (batch * tp))
    checkpointed = rows < local_len and torch.is_grad_enabled()

    def chunk_outputs(hidden: torch.Tensor, labels: torch.Tensor, entropies: list) -> torch.Tensor:
        logits, _ = output_layer(hidden, weight=output_weight)
        # Under checkpointing the backward runs this again: the entropy (no gradient) only once.
        logprobs, entropy = _logprob_and_entropy(logits, labels, context.temperature, with_entropy=not entropies)
        if entropy is not None:
            entropies.append(entropy)
        return logprobs

    logprobs, entropies, positions = [], [], []
    for start in range(0, local_len, rows):
        end = min(start + rows, local_len)
        index = torch.cat([torch.arange(k * local_len + start, k * local_len + end, device=hidden_states.device)
                           for k in range(tp)])
        labels = labels_sb.index_select(0, index)
        holder: list[torch.Tensor] = []
        if checkpointed:
            out = torch.utils.checkpoint.checkpoint(chunk_outputs, hidden_states[start:end], labels, holder,
                                                    use_reentrant=False)
        else:
            out = chunk_outputs(hidden_states[start:end], labels, holder)
        logprobs.append(out)
        entropies.append(holder[0])
        positions.append(index)
    logprobs_sb, entropy_sb = torch.cat(logprobs), torch.cat(entropies)
    if tp > 1:  # chunks hold rows of every TP slice: back to sequence order
        order = torch.cat(positions).argsort()
        logprobs_sb, entropy_sb = logprobs_sb.index_select(0, order), entropy_sb.index_select(0, order)
    return logprobs_sb.transpose(0, 1), entropy_sb.transpose(0, 1)
