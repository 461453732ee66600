"""The batched sampler (request parameters: sampling_params.py; logit adjustments: penalties.py).

Log-prob semantics, matched to SGLang's default (`python/sglang/srt/layers/sampler.py`): the
returned log-prob of a sampled token is `log_softmax(logits / temperature)[token]`, i.e. of the
temperature-scaled distribution *before* top-k / top-p / min-p filtering (SGLang computes
`log(softmax(logits / T))` and samples from a renormalised, filtered copy). A temperature below
1e-6 means greedy; SGLang then sets temperature to 1 and top_k to 1, so greedy log-probs are
`log_softmax(logits)`. With `return_original_logprob` (SGLang: the environment variable
`SGLANG_RETURN_ORIGINAL_LOGPROB=1`) the log-prob is always `log_softmax(logits)[token]`, the
temperature-1 distribution. At temperature 1 (the SAO recipes) all of these coincide; with top-p
or top-k filtering the returned number is not the log-prob of the distribution actually sampled
from — DIS compares the trainer's log-prob against it, so recipes that filter must know this
(docs/rollout.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_sao.cpu_engine.sampling_params import SAMPLING_EPS, TOP_K_ALL, SamplingConfig

logger = logging.getLogger(__name__)
__all__ = ["SAMPLING_EPS", "TOP_K_ALL", "BatchSamplingParams", "SamplingConfig", "sample_rows_isolated",
           "sample_tokens", "step_logprobs"]


@dataclass(slots=True)
class BatchSamplingParams:
    """Per-row sampling parameters of a batch as tensors (rebuilt when the batch changes)."""

    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    min_p: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    any_filtering: bool
    all_greedy: bool
    all_temperature_one: bool

    @classmethod
    def build(cls, configs: Sequence[SamplingConfig]) -> BatchSamplingParams:
        return cls(
            temperature=torch.tensor([c.temperature for c in configs], dtype=torch.float32),
            top_p=torch.tensor([c.top_p for c in configs], dtype=torch.float32),
            top_k=torch.tensor([c.top_k for c in configs], dtype=torch.int64),
            min_p=torch.tensor([c.min_p for c in configs], dtype=torch.float32),
            greedy=torch.tensor([c.greedy for c in configs], dtype=torch.bool),
            any_filtering=any(c.needs_filtering for c in configs),
            all_greedy=all(c.greedy for c in configs),
            all_temperature_one=all(c.temperature == 1.0 for c in configs),
        )


def sample_tokens(
    logits: torch.Tensor,
    params: BatchSamplingParams,
    generators: Sequence[torch.Generator | None],
    global_generator: torch.Generator | None = None,
    return_original_logprob: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V] (float32).

    Returns (tokens [B] int64, logprobs [B] float32) with the log-prob semantics of the module
    docstring. Rows with their own generator (a request `sampling_seed`) draw from it, so their
    tokens do not depend on the rest of the batch.
    """
    logits = logits.float()
    scaled = logits if params.all_temperature_one else logits / params.temperature.unsqueeze(1)
    logprobs_all = torch.log_softmax(logits if return_original_logprob else scaled, dim=-1)  # [B, V]

    if params.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = torch.softmax(scaled, dim=-1)
        if params.any_filtering:
            probs = _filter_probs(probs, params)
        tokens = _multinomial(probs, generators, global_generator)
        if params.greedy.any():
            tokens = torch.where(params.greedy, logits.argmax(dim=-1), tokens)
    logprobs = logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, logprobs


def _filter_probs(probs: torch.Tensor, params: BatchSamplingParams) -> torch.Tensor:
    """Top-k, top-p and min-p filtering, as SGLang's torch fallback sampler does it (on sorted
    probabilities; the kept mass is renormalised by the multinomial draw)."""
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1]).unsqueeze(0)
    drop = ranks >= params.top_k.unsqueeze(1)
    cumsum = probs_sort.cumsum(dim=-1)
    drop |= (cumsum - probs_sort) > params.top_p.unsqueeze(1)
    drop |= probs_sort < (probs_sort[:, :1] * params.min_p.unsqueeze(1))
    drop[:, 0] = False  # the most likely token always survives
    probs_sort = probs_sort.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, probs_idx, probs_sort)


def _multinomial(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    global_generator: torch.Generator | None,
) -> torch.Tensor:
    seeded = [i for i, g in enumerate(generators) if g is not None]
    tokens = torch.multinomial(probs, 1, generator=global_generator).squeeze(1)
    for i in seeded:
        tokens[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    return tokens


def sample_rows_isolated(
    logits: torch.Tensor,
    params: BatchSamplingParams,
    configs: Sequence[SamplingConfig],
    generators: Sequence[torch.Generator | None],
    global_generator: torch.Generator | None = None,
    return_original_logprob: bool = False,
) -> tuple[torch.Tensor, list[float | BaseException]]:
    """`sample_tokens`, but one bad row cannot fail the batch: if the batch fails, rows are
    sampled one at a time, and a row that fails on its own gets its exception in place of a
    log-prob (its token is a placeholder 0; the scheduler fails that request alone)."""
    try:
        tokens, logprobs = sample_tokens(logits, params, generators, global_generator, return_original_logprob)
        return tokens, logprobs.tolist()
    except Exception as batch_error:
        logger.warning("sampling %d rows failed (%r); sampling them one by one", len(configs), batch_error)
    tokens = torch.zeros(len(configs), dtype=torch.long)
    results: list[float | BaseException] = []
    for i, config in enumerate(configs):
        try:
            token, logprob = sample_tokens(logits[i : i + 1], BatchSamplingParams.build([config]), [generators[i]],
                                           global_generator, return_original_logprob)
            tokens[i] = token[0]
            results.append(float(logprob[0]))
        except Exception as e:
            results.append(e)
    return tokens, results


def step_logprobs(logits: torch.Tensor, config: SamplingConfig, return_original_logprob: bool) -> torch.Tensor:
    """The distribution [V] a sampled token's log-prob is read from (module docstring), for the
    top-k / token-id entries of one row (`logits` [V], already adjusted)."""
    logits = logits.float()
    if not return_original_logprob and config.temperature != 1.0:
        logits = logits / config.temperature
    return torch.log_softmax(logits, dim=-1)
