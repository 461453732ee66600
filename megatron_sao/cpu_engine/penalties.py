"""Logit adjustments before sampling: frequency / presence / repetition penalties, `min_new_tokens`
and `logit_bias`, as sglang 0.5.23's penalizers apply them.

Order (SGLang's penalizer orchestrator, then `logit_bias`): frequency (`- f * count`), min-new-tokens
(stop tokens and EOS at -inf while fewer than `min_new_tokens` tokens were generated), presence
(`- p` for every token generated at least once), repetition (a generated token's logit divided by
the penalty when positive, multiplied when negative), then `+ logit_bias`. Only output tokens count
(SGLang does not penalise prompt tokens). The adjusted logits are what is sampled from *and* what
the returned log-probs are computed from, as in SGLang: with a penalty, a returned log-prob is not
the model's own (docs/rollout.md).

Shape legend: B rows of the batch, V vocabulary (logits columns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_sao.cpu_engine.request import EngineRequest


def adjust_logits(logits: torch.Tensor, requests: Sequence[EngineRequest], eos_token_ids: frozenset[int]
                  ) -> torch.Tensor:
    """`logits` [B, V] with each request's adjustments applied (a copy when any row changes;
    `logits` itself when none does, the common case, so plain batches pay nothing)."""
    rows = [i for i, req in enumerate(requests) if req.sampling.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        _adjust_row(logits[i], requests[i], eos_token_ids)
    return logits


def _adjust_row(row: torch.Tensor, req: EngineRequest, eos_token_ids: frozenset[int]) -> None:
    """Adjust one row [V] in place."""
    cfg = req.sampling
    V = row.shape[0]
    counts = None
    if req.output_ids and (cfg.frequency_penalty or cfg.presence_penalty or cfg.repetition_penalty != 1.0):
        counts = torch.bincount(torch.tensor(req.output_ids, dtype=torch.long), minlength=V)[:V]
    if counts is not None and cfg.frequency_penalty:
        row.sub_(cfg.frequency_penalty * counts.to(row.dtype))
    if len(req.output_ids) < cfg.min_new_tokens:
        stops = [t for t in {*cfg.stop_token_ids, *eos_token_ids} if 0 <= t < V]
        if stops:
            row[torch.tensor(stops, dtype=torch.long)] = float("-inf")
    if counts is not None:
        seen = counts > 0
        if cfg.presence_penalty:
            row.sub_(cfg.presence_penalty * seen.to(row.dtype))
        if cfg.repetition_penalty != 1.0:
            p = cfg.repetition_penalty
            row.copy_(torch.where(seen, torch.where(row < 0, row * p, row / p), row))
    if cfg.logit_bias:
        ids = torch.tensor(list(cfg.logit_bias), dtype=torch.long)
        row.index_add_(0, ids, torch.tensor(list(cfg.logit_bias.values()), dtype=row.dtype))
