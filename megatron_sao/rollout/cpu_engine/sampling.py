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

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)
SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS: a temperature below this is greedy
TOP_K_ALL = 1 << 30  # SGLang's "no top-k" value (top_k = -1 on the wire)
# Bounds that keep one request's stop handling cheap (each stop string is tokenised at admission
# and searched for after every generated token).
MAX_STOP_ENTRIES = 64
MAX_STOP_CHARS = 1024

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
    def from_request(cls, params: Any) -> SamplingConfig:
        """Validate a wire dict whole. Raises ValueError naming the field for unknown fields, values of
        the wrong JSON type (never coerced: `"0.7"` is not a number), non-finite or out-of-range
        numbers, and SGLang features this engine does not implement."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a JSON object, got {_json_type(params)}")
        unknown = set(params) - _SUPPORTED - set(_NEUTRAL)
        if unknown:
            raise ValueError(f"unknown sampling_params field(s): {sorted(map(str, unknown))[:10]}")
        for name, neutral in _NEUTRAL.items():
            value = params.get(name, neutral)
            if value is None or (neutral is None and not value):
                continue
            if type(value) is not type(neutral) and not (isinstance(neutral, float) and _is_int(value)):
                raise ValueError(f"sampling_params.{name}={_short(value)} is not supported by the CPU engine")
            if value != neutral:
                raise ValueError(f"sampling_params.{name}={_short(value)} is not supported by the CPU engine")
        cfg = cls()
        if (v := _int(params, "max_new_tokens")) is not None:
            if v < 0:
                raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {v}")
            cfg.max_new_tokens = v
        if (f := _number(params, "temperature")) is not None:
            if f < 0:
                raise ValueError(f"sampling_params.temperature must be >= 0, got {f}")
            cfg.temperature = f
        if (f := _number(params, "top_p")) is not None:
            if not 0.0 < f <= 1.0:
                raise ValueError(f"sampling_params.top_p must be in (0, 1], got {f}")
            cfg.top_p = f
        if (v := _int(params, "top_k")) is not None:
            if v != -1 and v < 1:
                raise ValueError(f"sampling_params.top_k must be -1 or >= 1, got {v}")
            cfg.top_k = TOP_K_ALL if v == -1 or v > TOP_K_ALL else v
        if (f := _number(params, "min_p")) is not None:
            if not 0.0 <= f <= 1.0:
                raise ValueError(f"sampling_params.min_p must be in [0, 1], got {f}")
            cfg.min_p = f
        cfg.stop = _stop_strings(params.get("stop"))
        stop_ids = params.get("stop_token_ids")
        if stop_ids is not None:
            if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_ENTRIES or not all(map(_is_int, stop_ids)):
                raise ValueError(f"sampling_params.stop_token_ids must be a list of at most {MAX_STOP_ENTRIES} "
                                 f"integers, got {_short(stop_ids)}")
            cfg.stop_token_ids = list(stop_ids)
        for flag in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            value = params.get(flag)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"sampling_params.{flag} must be true or false, got {_short(value)}")
            if value is not None and flag != "spaces_between_special_tokens":
                setattr(cfg, flag, value)
        _int(params, "stream_interval")
        if (v := _int(params, "sampling_seed")) is not None:
            if not 0 <= v < 2**63:
                raise ValueError(f"sampling_params.sampling_seed must be in [0, 2**63), got {v}")
            cfg.sampling_seed = v
        if cfg.temperature < SAMPLING_EPS:  # SGLang: greedy is temperature 1 with top_k 1
            cfg.temperature = 1.0
            cfg.top_k = 1
        return cfg


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(params: dict[str, Any], name: str) -> int | None:
    """An integer field (JSON integer; a float with an integral value is accepted as JSON does not
    tell 3 from 3.0), or None when absent."""
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise ValueError(f"sampling_params.{name} must be an integer, got {_short(value)}")
    return value


def _number(params: dict[str, Any], name: str) -> float | None:
    """A finite JSON number, or None when absent (NaN / Infinity / strings are refused)."""
    value = params.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"sampling_params.{name} must be a number, got {_short(value)}")
    if not math.isfinite(value):
        raise ValueError(f"sampling_params.{name} must be finite, got {value}")
    return float(value)


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"sampling_params.stop must be a string or a list of strings, got {_short(stop)}")
    if len(stops) > MAX_STOP_ENTRIES or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"sampling_params.stop: at most {MAX_STOP_ENTRIES} strings of at most {MAX_STOP_CHARS} "
                         "characters each")
    if any(not s for s in stops):
        raise ValueError("sampling_params.stop strings must be non-empty")
    return list(stops)


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
