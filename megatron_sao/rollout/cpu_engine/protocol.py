"""SGLang's native `/generate` wire format: request parsing and response building.

Matched against SGLang's `GenerateReqInput` (python/sglang/srt/managers/io_struct.py) and the
tokenizer manager's non-streaming answer `{"text", "output_ids", "meta_info"}` (sglang 0.5.x;
`weight_versions` spans as in current SGLang main). Request fields this engine cannot honour are
refused with a message naming them when they are set to anything but their neutral value; fields
that do not change the result (`log_metrics`, `rid` of any shape SGLang accepts) are accepted.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import torch

from megatron_sao.rollout.cpu_engine.request import EngineRequest
from megatron_sao.rollout.cpu_engine.sampling import SamplingConfig

_ACCEPTED = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "stream",
    "log_metrics",
    "session_id",
    "custom_labels",
    "priority",
    "no_logs",
}
MAX_PROMPTS_PER_REQUEST = 1024
"""Prompts one batch `/generate` call may carry."""
MAX_RID_CHARS = 256


@dataclass(slots=True)
class ParsedGenerate:
    requests: list[EngineRequest]
    is_batch: bool


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


def _check_unsupported(body: dict[str, Any]) -> None:
    refused = sorted(str(k) for k, v in body.items() if k not in _ACCEPTED and v not in (None, False, [], {}, 0))
    if refused:
        raise ValueError(f"request field(s) {refused[:10]} are not supported by the CPU engine")
    if _bool(body.get("stream"), "stream"):
        raise ValueError("stream=true is not supported by the CPU engine")
    start = body.get("logprob_start_len")
    if start is not None and (not _is_int(start) or start != -1):
        raise ValueError("logprob_start_len other than -1 (prompt log-probs) is not supported by the CPU engine")
    if body.get("top_logprobs_num") not in (None, 0) or body.get("token_ids_logprob") not in (None, []):
        raise ValueError("top_logprobs_num / token_ids_logprob are not supported by the CPU engine")
    for name in ("log_metrics", "no_logs", "return_text_in_logprobs"):
        _bool(body.get(name), name)
    if body.get("priority") is not None and not _is_int(body["priority"]):
        raise ValueError(f"priority must be an integer, got {_short(body['priority'])}")
    for name, kind in (("session_id", str), ("custom_labels", dict)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise ValueError(f"{name} must be a {'string' if kind is str else 'JSON object'}, "
                             f"got {_short(body[name])}")


def parse_generate(body: Any, tokenizer, limits: PromptLimits) -> ParsedGenerate:
    """Validate a `/generate` body whole, before anything is queued; raises ValueError with a
    client-facing message naming the field. Never coerces a mistyped value."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    _check_unsupported(body)
    prompts, is_batch = _prompts(body, tokenizer, limits)
    num = len(prompts)
    sampling = body.get("sampling_params")
    if isinstance(sampling, list) and not is_batch:
        raise ValueError("a list of sampling_params needs a batch request of the same length")
    configs = _per_prompt(body, "sampling_params", num, is_batch, lambda v, n: _sampling(v, n))
    rids = _rids(body, num, is_batch)
    flags = _per_prompt(body, "return_logprob", num, is_batch, _bool)
    with_text = _bool(body.get("return_text_in_logprobs"), "return_text_in_logprobs")
    requests = []
    for i, ids in enumerate(prompts):
        config = configs[i]
        generator = None
        if config.sampling_seed is not None:
            generator = torch.Generator().manual_seed(config.sampling_seed)
        stop_window = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in config.stop), default=0) + 1
        requests.append(
            EngineRequest(
                rid=rids[i],
                input_ids=ids,
                sampling=config,
                max_new_tokens=min(config.max_new_tokens, limits.context_length - len(ids)),
                return_logprob=flags[i],
                return_text_in_logprobs=with_text,
                generator=generator,
                stop_window=stop_window,
            )
        )
    return ParsedGenerate(requests, is_batch)


def _sampling(value: Any, name: str) -> SamplingConfig:
    try:
        return SamplingConfig.from_request(value)
    except ValueError as e:
        message = str(e)
        if name != "sampling_params":
            message = message.replace("sampling_params", name, 1)
        raise ValueError(message) from e


def output_text(req: EngineRequest, tokenizer) -> str:
    """SGLang's detokenised `text`: a matched stop token / string is trimmed unless
    `no_stop_trim`; special tokens are skipped if `skip_special_tokens` (the default)."""
    ids = req.output_ids
    reason = req.finish_reason or {}
    matched = reason.get("matched") if reason.get("type") == "stop" else None
    if isinstance(matched, int) and not req.sampling.no_stop_trim:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=req.sampling.skip_special_tokens)
    if isinstance(matched, str) and not req.sampling.no_stop_trim:
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


def build_output(req: EngineRequest, tokenizer, current_version: str) -> dict[str, Any]:
    spans = req.weight_version_spans(current_version)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "weight_version": spans[-1]["version"],
        "weight_versions": spans,
        "e2e_latency": req.finished_at - req.created_at,
    }
    if req.return_logprob:
        if req.return_text_in_logprobs:
            texts: list[str | None] = [tokenizer.decode([t]) for t in req.output_ids]
        else:
            texts = [None] * len(req.output_ids)
        meta["output_token_logprobs"] = [
            [lp, tok, txt] for lp, tok, txt in zip(req.output_logprobs, req.output_ids, texts, strict=True)
        ]
    return {"text": output_text(req, tokenizer), "output_ids": list(req.output_ids), "meta_info": meta}
