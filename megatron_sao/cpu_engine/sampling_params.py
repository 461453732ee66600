"""SGLang's `sampling_params` dict (sglang 0.5.23 `SamplingParams`), validated and normalised.

Every field of SGLang's `SamplingParams` is accepted. What a CPU engine can honour is honoured
(sampling, stops, `stop_regex`, penalties, `min_new_tokens`, `n`, `logit_bias`, seeds,
detokenisation flags); a field it cannot honour (constrained decoding, beam search, watermarks,
SGLang-internal fields) is accepted at its default value and refused with a ValueError naming it
otherwise. Range checks follow `SamplingParams.verify`; values are never coerced (`"0.7"` is not a
number), so a mistyped request is a 400, not a silently different generation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from megatron_sao.cpu_engine.stops import compile_stop_regex

SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS: a temperature below this is greedy
TOP_K_ALL = 1 << 30  # SGLang's "no top-k" value (top_k = -1 on the wire)
# Bounds that keep one request's stop handling cheap (each stop string is tokenised at admission
# and searched for after every generated token).
MAX_STOP_ENTRIES = 64
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS_ENTRIES = 4096
MAX_N = 128
"""Largest `n` (parallel samples of one prompt); the prompt count times `n` is bounded too."""

_HONOURED = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "stop_regex",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params",
}
# SGLang fields the CPU engine cannot honour: accepted at their default only. `custom_params` is
# honoured trivially (SGLang hands it to custom logit processors only, which the engine refuses).
_DEFAULT_ONLY: dict[str, Any] = {
    "beam_width": 1,  # None or 1: not a beam search
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "watermark": None,
    # SGLang-internal fields (filled by its normalize(); a client has no reason to send them)
    "stop_strs": None,
    "stop_regex_strs": None,
    "stop_str_max_len": 0,
    "stop_regex_max_len": 0,
    "is_normalized": False,
    "ebnf_full_assistant": False,
}
SAMPLING_FIELDS = frozenset(_HONOURED | set(_DEFAULT_ONLY))


@dataclass(slots=True)
class SamplingConfig:
    """A validated `sampling_params` dict, normalised the way SGLang normalises it."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    stop_patterns: list[re.Pattern[str]] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def needs_filtering(self) -> bool:
        return not self.greedy and (self.top_k < TOP_K_ALL or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties.py)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.min_new_tokens or self.logit_bias)

    @classmethod
    def from_request(cls, params: Any) -> SamplingConfig:
        """Validate a wire dict whole. Raises ValueError naming the field for unknown fields, values of
        the wrong JSON type, non-finite or out-of-range numbers, and non-default values of SGLang
        features this engine does not implement."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a JSON object, got {_json_type(params)}")
        unknown = set(params) - SAMPLING_FIELDS
        if unknown:
            raise ValueError(f"unknown sampling_params field(s): {sorted(map(str, unknown))[:10]}")
        for name, default in _DEFAULT_ONLY.items():
            if not is_default(params.get(name), default):
                raise ValueError(f"sampling_params.{name}={_short(params[name])} is not supported by the CPU engine "
                                 "(only its default is accepted)")
        cfg = cls()
        if (v := _int(params, "max_new_tokens")) is not None:
            if v < 0:
                raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {v}")
            cfg.max_new_tokens = v
        cfg.temperature = _ranged(params, "temperature", 1.0, lambda f: f >= 0, ">= 0")
        cfg.top_p = _ranged(params, "top_p", 1.0, lambda f: 0.0 < f <= 1.0, "in (0, 1]")
        if (v := _int(params, "top_k")) is not None:
            if v != -1 and v < 1:
                raise ValueError(f"sampling_params.top_k must be -1 or >= 1, got {v}")
            cfg.top_k = TOP_K_ALL if v == -1 or v > TOP_K_ALL else v
        cfg.min_p = _ranged(params, "min_p", 0.0, lambda f: 0.0 <= f <= 1.0, "in [0, 1]")
        cfg.frequency_penalty = _ranged(params, "frequency_penalty", 0.0, lambda f: -2.0 <= f <= 2.0, "in [-2, 2]")
        cfg.presence_penalty = _ranged(params, "presence_penalty", 0.0, lambda f: -2.0 <= f <= 2.0, "in [-2, 2]")
        cfg.repetition_penalty = _ranged(params, "repetition_penalty", 1.0, lambda f: 0.0 < f <= 2.0,
                                         "in (0, 2] (1 = no penalty)")
        if (v := _int(params, "min_new_tokens")) is not None:
            if not 0 <= v <= cfg.max_new_tokens:
                raise ValueError(f"sampling_params.min_new_tokens must be in [0, max_new_tokens "
                                 f"({cfg.max_new_tokens})], got {v}")
            cfg.min_new_tokens = v
        if (v := _int(params, "n")) is not None:
            if not 1 <= v <= MAX_N:
                raise ValueError(f"sampling_params.n must be in [1, {MAX_N}], got {v}")
            cfg.n = v
        cfg.stop = _strings(params.get("stop"), "stop", MAX_STOP_ENTRIES, MAX_STOP_CHARS)
        cfg.stop_regex = _strings(params.get("stop_regex"), "stop_regex", 32, 1024)
        cfg.stop_patterns = [compile_stop_regex(p, f"sampling_params.stop_regex[{i}]")
                             for i, p in enumerate(cfg.stop_regex)]
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
            if value is not None:
                setattr(cfg, flag, value)
        if (v := _int(params, "stream_interval")) is not None:
            if v < 1:
                raise ValueError(f"sampling_params.stream_interval must be >= 1, got {v}")
            cfg.stream_interval = v
        cfg.logit_bias = _logit_bias(params.get("logit_bias"))
        custom = params.get("custom_params")
        if custom is not None and not isinstance(custom, dict):
            raise ValueError(f"sampling_params.custom_params must be a JSON object, got {_short(custom)}")
        if (v := _int(params, "sampling_seed")) is not None:
            if not 0 <= v < 2**63:
                raise ValueError(f"sampling_params.sampling_seed must be in [0, 2**63), got {v}")
            cfg.sampling_seed = v
        if cfg.temperature < SAMPLING_EPS:  # SGLang: greedy is temperature 1 with top_k 1
            cfg.temperature = 1.0
            cfg.top_k = 1
        return cfg


def is_default(value: Any, default: Any) -> bool:
    """SGLang's neutral value of a field: null, its default, or an empty / all-null container
    (e.g. `lora_path: [null, null]` in a batch, `regex: ""`, which SGLang reads as unset)."""
    if value is None:
        return True
    if isinstance(value, (list, dict, str)) and not value:
        return True
    if isinstance(value, list):
        return all(is_default(v, default) for v in value)
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    if isinstance(default, (int, float)) and isinstance(value, (int, float)):
        return value == default
    return False


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


def _ranged(params: dict[str, Any], name: str, default: float, ok, rule: str) -> float:
    """A finite JSON number satisfying `ok` (NaN / Infinity / strings are refused), or `default`."""
    value = params.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"sampling_params.{name} must be a number, got {_short(value)}")
    if not math.isfinite(value):
        raise ValueError(f"sampling_params.{name} must be finite, got {value}")
    if not ok(value):
        raise ValueError(f"sampling_params.{name} must be {rule}, got {value}")
    return float(value)


def _strings(value: Any, name: str, max_entries: int, max_chars: int) -> list[str]:
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) for s in values):
        raise ValueError(f"sampling_params.{name} must be a string or a list of strings, got {_short(value)}")
    if len(values) > max_entries or any(len(s) > max_chars for s in values):
        raise ValueError(f"sampling_params.{name}: at most {max_entries} strings of at most {max_chars} "
                         "characters each")
    if any(not s for s in values):
        raise ValueError(f"sampling_params.{name} strings must be non-empty")
    return list(values)


def _logit_bias(value: Any) -> dict[int, float]:
    """`{"token id": bias}` (JSON keys are strings); token ids are checked against the vocabulary
    when the request is parsed (protocol.py), which knows it."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"sampling_params.logit_bias must be an object of at most {MAX_LOGIT_BIAS_ENTRIES} "
                         f"{{token id: bias}} entries, got {_short(value)}")
    bias: dict[int, float] = {}
    for key, b in value.items():
        token = str(key).strip()
        if not token.lstrip("-").isdigit():
            raise ValueError(f"sampling_params.logit_bias keys must be token ids, got {_short(key)}")
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b):
            raise ValueError(f"sampling_params.logit_bias[{key}] must be a finite number, got {_short(b)}")
        bias[int(token)] = float(b)
    return bias
