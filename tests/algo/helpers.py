"""Builders of small multi-turn batches for the algorithm tests."""

from __future__ import annotations

import torch


def turn_mask(span_lengths: list[list[int]], num_tokens: int, prompt: int = 0) -> torch.Tensor:
    """`[B, T]` mask: per row a prompt, then alternating action / observation spans, then padding.

    `span_lengths[b]` lists the spans of row b starting with an action span.
    """
    mask = torch.zeros(len(span_lengths), num_tokens, dtype=torch.bool)
    for b, spans in enumerate(span_lengths):
        start = prompt
        for i, length in enumerate(spans):
            if i % 2 == 0:
                mask[b, start:start + length] = True
            start += length
        assert start <= num_tokens, "spans do not fit"
    return mask


def random_turn_batch(batch: int, num_tokens: int, turns: int, gen: torch.Generator,
                      dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards, values, mask of `batch` rows with up to `turns` action spans, then padding.

    Rewards: 1.0 on one random position (anywhere: on an action token, an observation, padding or
    the prompt) and N(0, 1) on ~5% of the non-action tokens; values are N(0, 1) everywhere.
    """
    spans_per_row, prompts = [], []
    for _ in range(batch):
        prompt = int(torch.randint(0, max(1, num_tokens // 4), (), generator=gen))
        spans, used = [], prompt
        for _ in range(2 * turns - 1):
            span = int(torch.randint(1, 12, (), generator=gen))
            if used + span > num_tokens:
                break
            spans.append(span)
            used += span
        spans_per_row.append(spans)
        prompts.append(prompt)
    mask = torch.stack([turn_mask([spans], num_tokens, prompt)[0]
                        for spans, prompt in zip(spans_per_row, prompts, strict=True)])
    rewards = torch.zeros(batch, num_tokens, dtype=dtype)
    sprinkled = ~mask & (torch.rand(batch, num_tokens, generator=gen) < 0.05)
    rewards[sprinkled] = torch.randn(int(sprinkled.sum()), generator=gen, dtype=dtype)
    rewards[torch.arange(batch), torch.randint(0, num_tokens, (batch,), generator=gen)] += 1.0
    values = torch.randn(batch, num_tokens, generator=gen, dtype=dtype)
    return rewards, values, mask


def textbook_gae(rewards_k: list[float], values_k: list[float], gamma: float, lam: float) -> list[float]:
    """Standard GAE of one sequence of steps (value after the last step 0), in plain Python."""
    adv, next_value, next_adv = [0.0] * len(rewards_k), 0.0, 0.0
    for k in range(len(rewards_k) - 1, -1, -1):
        delta = rewards_k[k] + gamma * next_value - values_k[k]
        next_adv = delta + gamma * lam * next_adv
        adv[k] = next_adv
        next_value = values_k[k]
    return adv
