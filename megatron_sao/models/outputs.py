"""Per-token outputs of the actor and the critic, aligned to token positions.

Convention (shared with `megatron_sao.algo` and the trajectory record): index t of a `[B, T]`
tensor belongs to token t. The model's output at position t-1 has seen tokens 0..t-1, so
  logprobs[:, t] = log pi(token_t | tokens_<t)   (read from the logits at t-1)
  values[:, t]   = V(state before token t)        (read from the hidden state at t-1)
and both are 0 at t = 0, which is always a prompt token.
"""

from __future__ import annotations

import torch


def shifted_labels(input_ids_bt: torch.Tensor) -> torch.Tensor:
    """Labels for Megatron's fused vocab-parallel cross entropy: position t predicts token t+1."""
    return torch.roll(input_ids_bt, shifts=-1, dims=1)


def logprobs_from_token_loss(token_loss_bt: torch.Tensor) -> torch.Tensor:
    """GPTModel(labels=shifted_labels(ids)) returns -log p(token_{t+1}) at t; realign to token t."""
    logprobs_bt = torch.zeros_like(token_loss_bt, dtype=torch.float32)
    logprobs_bt[:, 1:] = -token_loss_bt[:, :-1].float()
    return logprobs_bt


def values_from_head(head_bt1: torch.Tensor) -> torch.Tensor:
    """Critic output [B, T, 1] (head at each position) -> V before each token, [B, T]."""
    values_bt = torch.zeros(head_bt1.shape[:2], dtype=torch.float32, device=head_bt1.device)
    values_bt[:, 1:] = head_bt1[:, :-1, 0].float()
    return values_bt


def position_ids_for(input_ids_bt: torch.Tensor) -> torch.Tensor:
    batch, seq = input_ids_bt.shape
    return torch.arange(seq, device=input_ids_bt.device).unsqueeze(0).expand(batch, seq).contiguous()

