"""SGLang's native `/generate` request: parsing and validation into engine requests.

Matched against sglang 0.5.23's `GenerateReqInput` (python/sglang/srt/managers/io_struct.py) and
its normalisation: single or batch prompts (`text` or `input_ids`), per-prompt or shared
`sampling_params` and log-prob options, and `n > 1` expanded prompt-major (prompt 0's n samples,
then prompt 1's), each sample under a fresh request id as SGLang's tokenizer manager does. Which
request fields are honoured, accepted as metadata or refused: surface.py; sampling fields:
sampling_params.py. The body is validated whole before anything is queued; answers: output.py
and streaming.py.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import torch

from megatron_sao.cpu_engine.logprobs import LogprobState
from megatron_sao.cpu_engine.request import EngineRequest
from megatron_sao.cpu_engine.sampling_params import SamplingConfig
from megatron_sao.cpu_engine.stops import stop_window
from megatron_sao.cpu_engine.surface import check_request_fields

MAX_PROMPTS_PER_REQUEST = 1024
"""Generations one `/generate` call may ask for (prompts x `n`)."""
MAX_RID_CHARS = 256


@dataclass(slots=True)
class ParsedGenerate:
    requests: list[EngineRequest]
    is_batch: bool
    """Answer a list (a batch of prompts, or n > 1) rather than one object."""
    stream: bool = False


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What one prompt may be, checked before it costs anything."""

    context_length: int
    vocab_size: int
    max_prompt_chars: int
    """A `text` prompt longer than this is refused before tokenisation: no tokenizer turns more
    characters than (context length x longest vocabulary entry) into fewer tokens than the context."""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _per_prompt(body: dict[str, Any], name: str, num: int, is_batch: bool, check) -> list[Any]:
    """A field that is one value for every prompt or (batch requests) a list of one per prompt."""
    value = body.get(name)
    if is_batch and isinstance(value, list):
        if len(value) != num:
            raise ValueError(f"{name}: a list needs one entry per prompt ({num}), got {len(value)}")
        return [check(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return [check(value, name)] * num


def _bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {_short(value)}")
    return value


def _prompts(body: dict[str, Any], tokenizer, limits: PromptLimits) -> tuple[list[list[int]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("exactly one of text or input_ids must be given")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids (or of such lists)")
        is_batch = isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise ValueError(f"input_ids: at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(prompts)}")
        for i, ids in enumerate(prompts):
            name = f"input_ids[{i}]" if is_batch else "input_ids"
            if not isinstance(ids, list) or not ids:
                raise ValueError(f"{name} must be a non-empty list of token ids")
            if len(ids) >= limits.context_length:
                raise ValueError(f"{name}: the input ({len(ids)} tokens) does not fit the model's context length "
                                 f"({limits.context_length})")
            if not all(_is_int(t) and 0 <= t < limits.vocab_size for t in ids):
                bad = next(t for t in ids if not (_is_int(t) and 0 <= t < limits.vocab_size))
                raise ValueError(f"{name}: token ids must be integers in [0, {limits.vocab_size}) (the model's "
                                 f"vocabulary), got {_short(bad)}")
        return [list(p) for p in prompts], is_batch
    is_batch = isinstance(text, list)
    texts = text if is_batch else [text]
    if not texts:
        raise ValueError("text must be a non-empty string or list of strings")
    if len(texts) > MAX_PROMPTS_PER_REQUEST:
        raise ValueError(f"text: at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(texts)}")
    for i, t in enumerate(texts):
        name = f"text[{i}]" if is_batch else "text"
        if not isinstance(t, str) or not t:
            raise ValueError(f"{name} must be a non-empty string, got {_short(t)}")
        if len(t) > limits.max_prompt_chars:
            raise ValueError(f"{name}: {len(t)} characters cannot fit the model's context length "
                             f"({limits.context_length} tokens); the limit is {limits.max_prompt_chars} characters")
    prompts = [tokenizer.encode(t) for t in texts]  # bounded above; the server calls this off its event loop
    for i, ids in enumerate(prompts):
        if len(ids) >= limits.context_length:
            raise ValueError(f"{f'text[{i}]' if is_batch else 'text'}: the input ({len(ids)} tokens) does not fit "
                             f"the model's context length ({limits.context_length})")
        if not ids:
            raise ValueError("text tokenises to no tokens")
    return prompts, is_batch


def _rids(body: dict[str, Any], num: int, is_batch: bool) -> list[str]:
    rid = body.get("rid")
    if rid is None:
        return [uuid.uuid4().hex for _ in range(num)]
    if isinstance(rid, str):
        rids = [rid] if not is_batch else [f"{rid}_{i}" for i in range(num)]
    elif isinstance(rid, list) and len(rid) == num and all(isinstance(r, str) for r in rid):
        rids = list(rid)
    else:
        raise ValueError(f"rid must be a string or a list of strings, one per prompt; got {_short(rid)}")
    if any(not r or len(r) > MAX_RID_CHARS for r in rids):
        raise ValueError(f"rid: ids must be 1 to {MAX_RID_CHARS} characters")
    if len(set(rids)) != len(rids):
        raise ValueError(f"duplicate request ids in one request: {_short(rids)}")
    return rids


def _logprob_state(body: dict[str, Any], num: int, is_batch: bool, n: int, prompts: list[list[int]],
                   limits: PromptLimits) -> list[LogprobState | None]:
    """Per prompt: the log-prob options when `return_logprob` is set (SGLang ignores the others
    without it). With n > 1 the options must be one value for all prompts, as in SGLang."""
    if n > 1:
        for name in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
            if isinstance(body.get(name), list):
                raise ValueError(f"{name}: a list cannot be combined with sampling_params.n > 1")
        token_ids = body.get("token_ids_logprob")
        if isinstance(token_ids, list) and token_ids and isinstance(token_ids[0], list):
            raise ValueError("token_ids_logprob: a list per prompt cannot be combined with sampling_params.n > 1")
    flags = _per_prompt(body, "return_logprob", num, is_batch, _bool)
    starts = _per_prompt(body, "logprob_start_len", num, is_batch, _int_at_least(-1))
    tops = _per_prompt(body, "top_logprobs_num", num, is_batch, _int_at_least(0))
    token_ids = _token_ids_logprob(body.get("token_ids_logprob"), num, is_batch, limits.vocab_size)
    states: list[LogprobState | None] = []
    for i in range(num):
        if not flags[i]:
            states.append(None)
            continue
        start = starts[i] if starts[i] is not None and starts[i] >= 0 else None
        if start is not None and start > len(prompts[i]):
            raise ValueError(f"logprob_start_len ({start}) is higher than the number of input tokens "
                             f"({len(prompts[i])})")
        top = tops[i] or 0
        if top > limits.vocab_size:
            raise ValueError(f"top_logprobs_num ({top}) exceeds the vocabulary size ({limits.vocab_size})")
        states.append(LogprobState(start=start, top_n=top, token_ids=token_ids[i]))
    return states


def _routed_experts_start(body: dict[str, Any], prompts: list[list[int]]) -> int | None:
    """`routed_experts_start_len` when `return_routed_experts` is set (one value for every prompt,
    as in SGLang's `GenerateReqInput`), else None. SGLang aborts a request whose start is negative
    or beyond its prompt, with these messages (`managers/scheduler.py`); here that is a 400."""
    start = body.get("routed_experts_start_len")
    if start is not None and not _is_int(start):
        raise ValueError(f"routed_experts_start_len must be an integer, got {_short(start)}")
    if not _bool(body.get("return_routed_experts"), "return_routed_experts"):
        return None
    start = start or 0
    if start < 0:
        raise ValueError(f"routed_experts_start_len={start} is lower than 0. Please use a non-negative "
                         "routed_experts_start_len.")
    shortest = min(len(p) for p in prompts)
    if start > shortest:
        raise ValueError(f"routed_experts_start_len={start} is higher than the number of input tokens "
                         f"({shortest}). Please use a smaller routed_experts_start_len.")
    return start


def _int_at_least(low: int):
    def check(value: Any, name: str) -> int | None:
        if value is None:
            return None
        if not _is_int(value) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {_short(value)}")
        return value
    return check


def _token_ids_logprob(value: Any, num: int, is_batch: bool, vocab_size: int) -> list[list[int] | None]:
    """`token_ids_logprob`: one list of ids for every prompt, or (batch) one list per prompt."""
    if value is None or value == []:
        return [None] * num
    if not isinstance(value, list):
        raise ValueError(f"token_ids_logprob must be a list of token ids, got {_short(value)}")
    per_prompt = is_batch and isinstance(value[0], list)
    lists = value if per_prompt else [value] * num
    if len(lists) != num:
        raise ValueError(f"token_ids_logprob: a list needs one entry per prompt ({num}), got {len(lists)}")
    for ids in lists:
        if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"token_ids_logprob: token ids must be integers in [0, {vocab_size}), "
                             f"got {_short(ids)}")
    return [list(ids) or None for ids in lists]


def parse_generate(body: Any, tokenizer, limits: PromptLimits) -> ParsedGenerate:
    """Validate a `/generate` body whole, before anything is queued; raises ValueError with a
    client-facing message naming the field. Never coerces a mistyped value."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    check_request_fields(body)
    stream = _bool(body.get("stream"), "stream")
    with_text = _bool(body.get("return_text_in_logprobs"), "return_text_in_logprobs")
    with_prompt_ids = _bool(body.get("return_prompt_token_ids"), "return_prompt_token_ids")
    for name in ("log_metrics", "no_logs"):
        _bool(body.get(name), name)
    prompts, is_batch = _prompts(body, tokenizer, limits)
    num = len(prompts)
    sampling = body.get("sampling_params")
    if isinstance(sampling, list) and not is_batch:
        raise ValueError("a list of sampling_params needs a batch request of the same length")
    configs = _per_prompt(body, "sampling_params", num, is_batch, lambda v, n: _sampling(v, n))
    n = configs[0].n
    if any(c.n != n for c in configs):
        raise ValueError("sampling_params.n must be the same for every prompt of a request")
    if num * n > MAX_PROMPTS_PER_REQUEST:
        raise ValueError(f"sampling_params.n: {num} prompts x n={n} exceeds {MAX_PROMPTS_PER_REQUEST} "
                         "generations per request")
    for i, config in enumerate(configs):
        bad = [t for t in config.logit_bias if not 0 <= t < limits.vocab_size]
        if bad:
            raise ValueError(f"sampling_params{f'[{i}]' if is_batch else ''}.logit_bias: token ids must be in "
                             f"[0, {limits.vocab_size}), got {bad[:5]}")
    rids = _rids(body, num, is_batch)
    logprobs = _logprob_state(body, num, is_batch, n, prompts, limits)
    routed_start = _routed_experts_start(body, prompts)
    requests = []
    for i, ids in enumerate(prompts):
        config = configs[i]
        window = stop_window([len(tokenizer.encode(s, add_special_tokens=False)) for s in config.stop],
                             config.stop_regex)
        for _ in range(n):
            generator = None
            if config.sampling_seed is not None:
                generator = torch.Generator().manual_seed(config.sampling_seed)
            state = logprobs[i]
            requests.append(EngineRequest(
                rid=rids[i] if n == 1 else uuid.uuid4().hex,
                input_ids=ids,
                sampling=config,
                max_new_tokens=min(config.max_new_tokens, limits.context_length - len(ids)),
                return_logprob=state is not None,
                return_text_in_logprobs=with_text,
                logprobs=None if state is None else LogprobState(state.start, state.top_n, state.token_ids),
                return_prompt_token_ids=with_prompt_ids,
                routed_experts_start_len=routed_start,
                generator=generator,
                stop_window=window,
            ))
    return ParsedGenerate(requests, is_batch or n > 1, stream)


def _sampling(value: Any, name: str) -> SamplingConfig:
    try:
        return SamplingConfig.from_request(value)
    except ValueError as e:
        message = str(e)
        if name != "sampling_params":
            message = message.replace("sampling_params", name, 1)
        raise ValueError(message) from e
