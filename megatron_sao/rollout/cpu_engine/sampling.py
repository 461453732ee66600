"""Sampling parameters (SGLang's `sampling_params` dict) and the batched sampler.

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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS: a temperature below this is greedy
TOP_K_ALL = 1 << 30  # SGLang's "no top-k" value (top_k = -1 on the wire)

# Fields SGLang's SamplingParams accepts that this engine implements.
_SUPPORTED = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "sampling_seed",
    "stream_interval",  # streaming-only; harmless on a non-streamed request
}
# Fields SGLang accepts that this engine accepts only at their neutral value.
_NEUTRAL: dict[str, Any] = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "logit_bias": None,
}


@dataclass(slots=True)
class SamplingConfig:
    """A validated `sampling_params` dict, normalised the way SGLang normalises it."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def needs_filtering(self) -> bool:
        return not self.greedy and (self.top_k < TOP_K_ALL or self.top_p < 1.0 or self.min_p > 0.0)

    @classmethod
    def from_request(cls, params: dict[str, Any] | None) -> SamplingConfig:
        """Validate a wire dict. Raises ValueError for unknown fields, bad values, and SGLang
        features this engine does not implement (named in the message)."""
        params = dict(params or {})
        unknown = set(params) - _SUPPORTED - set(_NEUTRAL)
        if unknown:
            raise ValueError(f"unknown sampling_params field(s): {sorted(unknown)}")
        for name, neutral in _NEUTRAL.items():
            value = params.get(name, neutral)
            if value is not None and value != neutral and not (neutral is None and not value):
                raise ValueError(f"sampling_params.{name}={value!r} is not supported by the CPU engine")
        cfg = cls()
        if params.get("max_new_tokens") is not None:
            cfg.max_new_tokens = int(params["max_new_tokens"])
            if cfg.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be >= 0, got {cfg.max_new_tokens}")
        if params.get("temperature") is not None:
            cfg.temperature = float(params["temperature"])
            if cfg.temperature < 0:
                raise ValueError(f"temperature must be >= 0, got {cfg.temperature}")
        if params.get("top_p") is not None:
            cfg.top_p = float(params["top_p"])
            if not 0.0 < cfg.top_p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {cfg.top_p}")
        if params.get("top_k") is not None:
            cfg.top_k = int(params["top_k"])
            if cfg.top_k == -1:
                cfg.top_k = TOP_K_ALL
            elif cfg.top_k < 1:
                raise ValueError(f"top_k must be -1 or >= 1, got {cfg.top_k}")
        if params.get("min_p") is not None:
            cfg.min_p = float(params["min_p"])
            if not 0.0 <= cfg.min_p <= 1.0:
                raise ValueError(f"min_p must be in [0, 1], got {cfg.min_p}")
        stop = params.get("stop")
        if stop is not None:
            cfg.stop = [stop] if isinstance(stop, str) else [str(s) for s in stop]
            if any(not s for s in cfg.stop):
                raise ValueError("stop strings must be non-empty")
        if params.get("stop_token_ids") is not None:
            cfg.stop_token_ids = [int(t) for t in params["stop_token_ids"]]
        for flag in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if params.get(flag) is not None:
                setattr(cfg, flag, bool(params[flag]))
        if params.get("sampling_seed") is not None:
            cfg.sampling_seed = int(params["sampling_seed"])
        if cfg.temperature < SAMPLING_EPS:  # SGLang: greedy is temperature 1 with top_k 1
            cfg.temperature = 1.0
            cfg.top_k = 1
        return cfg


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
