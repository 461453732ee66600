"""The model-facing halves of the scheduler's prefill and decode steps, as plain functions: run a
prefill keeping what prompt log-probs need, and turn one step's logits into tokens (logit
adjustments, sampling, top-k / token-id log-probs). The scheduler owns the batch and the cache.

Shape legend: B rows, k kept prompt positions, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_sao.cpu_engine.kv_cache import RowKVCache
from megatron_sao.cpu_engine.model_runner import ModelRunner
from megatron_sao.cpu_engine.penalties import adjust_logits
from megatron_sao.cpu_engine.request import EngineRequest
from megatron_sao.cpu_engine.sampling import BatchSamplingParams, sample_rows_isolated, step_logprobs


def prefill(runner: ModelRunner, group: Sequence[EngineRequest]) -> tuple[RowKVCache, torch.Tensor]:
    """Prefill `group` (prompt plus any output kept from before a retraction). Returns the cache and
    each row's last logits [B, V]; rows that asked for prompt log-probs get them recorded from the
    logits of their prompt positions, kept for this forward only."""
    sequences = [r.input_ids + r.output_ids for r in group]
    keep_last = max(_prompt_positions(r) for r in group)
    if keep_last == 1:  # the common case keeps one position (and the runner's plain entry point)
        cache, logits = runner.prefill(sequences)
        all_logits = logits[:, None, :]
    else:
        cache, all_logits = runner.prefill_last(sequences, keep_last)  # [B, k, V]
        logits = all_logits[:, -1, :]
    for req, rows in zip(group, all_logits, strict=True):
        if req.logprobs is not None and req.logprobs.wants_prompt(req.input_ids):
            req.logprobs.record_prompt(req.input_ids, rows)
    record_routing(runner, group, [0] * len(group), [len(s) for s in sequences])
    return cache, logits


def record_routing(runner: ModelRunner, requests: Sequence[EngineRequest], starts: Sequence[int],
                   lengths: Sequence[int]) -> None:
    """Keep the last forward's routing of each request that asked for it: row i computed positions
    `[starts[i], starts[i] + lengths[i])` in its last `lengths[i]` columns (rows are left-padded)."""
    routing_bslk = runner.last_routing
    if routing_bslk is None:
        return
    width = routing_bslk.shape[1]
    for i, req in enumerate(requests):
        if req.routing is not None:
            req.routing.record(starts[i], routing_bslk[i, width - lengths[i]:].numpy())


def sample(logits: torch.Tensor, params: BatchSamplingParams, requests: Sequence[EngineRequest],
           eos_token_ids: frozenset[int], global_generator: torch.Generator | None, return_original_logprob: bool
           ) -> tuple[torch.Tensor, list[float | BaseException]]:
    """Adjust the logits [B, V] (penalties.py), sample one token per row, and record the top-k /
    token-id log-probs of the rows that asked for them (before the token itself is appended, so a
    stream never sees one without the other). A row's failure is its result (sampling.py)."""
    logits = adjust_logits(logits, requests, eos_token_ids)
    tokens, results = sample_rows_isolated(
        logits, params, [r.sampling for r in requests], [r.generator for r in requests],
        global_generator, return_original_logprob,
    )
    for i, req in enumerate(requests):
        if req.logprobs is not None and req.logprobs.wants_distribution and isinstance(results[i], float):
            req.logprobs.record_output(step_logprobs(logits[i], req.sampling, return_original_logprob))
    return tokens, results


def needs_prefill(req: EngineRequest) -> bool:
    """Whether a request must be prefilled: it generates, or it wants prompt log-probs or routing."""
    return (req.max_new_tokens > 0 or (req.logprobs is not None and req.logprobs.wants_prompt(req.input_ids))
            or req.routed_experts_start_len is not None)


def _prompt_positions(req: EngineRequest) -> int:
    """Prompt positions whose logits `req`'s prefill must keep (1: only the last, to sample)."""
    return 1 if req.logprobs is None else req.logprobs.prompt_positions(len(req.input_ids))
