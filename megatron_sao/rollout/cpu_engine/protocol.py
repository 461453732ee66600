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


@dataclass(slots=True)
class ParsedGenerate:
    requests: list[EngineRequest]
    is_batch: bool


def parse_generate(body: Any, tokenizer, context_length: int, vocab_size: int) -> ParsedGenerate:
    """Validate a `/generate` body; raises ValueError with a client-facing message."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    refused = sorted(k for k, v in body.items() if k not in _ACCEPTED and v not in (None, False, [], {}, 0))
    if refused:
        raise ValueError(f"request field(s) {refused} are not supported by the CPU engine")
    if body.get("stream"):
        raise ValueError("stream=true is not supported by the CPU engine")
    if body.get("logprob_start_len") not in (None, -1):
        raise ValueError("logprob_start_len other than -1 (prompt log-probs) is not supported by the CPU engine")
    if body.get("top_logprobs_num") not in (None, 0) or body.get("token_ids_logprob"):
        raise ValueError("top_logprobs_num / token_ids_logprob are not supported by the CPU engine")

    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("exactly one of text or input_ids must be given")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids cannot be empty")
        is_batch = isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
    else:
        is_batch = isinstance(text, list)
        prompts = [tokenizer.encode(t) for t in (text if is_batch else [text])]
    num = len(prompts)

    sampling = body.get("sampling_params")
    if isinstance(sampling, list):
        if not is_batch or len(sampling) != num:
            raise ValueError("a list of sampling_params needs a batch request of the same length")
        sampling_list = sampling
    else:
        sampling_list = [sampling] * num

    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rid, str):
        rids = [rid] if not is_batch else [f"{rid}_{i}" for i in range(num)]
    elif isinstance(rid, list) and len(rid) == num:
        rids = [str(r) for r in rid]
    else:
        raise ValueError("rid must be a string or a list with one id per prompt")
    if len(set(rids)) != len(rids):
        raise ValueError(f"duplicate request ids in one request: {rids}")

    return_logprob = body.get("return_logprob") or False
    flags = return_logprob if isinstance(return_logprob, list) else [bool(return_logprob)] * num
    requests = []
    for i in range(num):
        ids = [int(t) for t in prompts[i]]
        if not ids:
            raise ValueError("input_ids cannot be empty")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"input_ids must be in [0, {vocab_size}) (the model's vocabulary)")
        if len(ids) >= context_length:
            raise ValueError(
                f"the input ({len(ids)} tokens) does not fit the model's context length ({context_length})"
            )
        config = SamplingConfig.from_request(sampling_list[i])
        generator = None
        if config.sampling_seed is not None:
            generator = torch.Generator().manual_seed(config.sampling_seed)
        stop_window = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in config.stop), default=0) + 1
        requests.append(
            EngineRequest(
                rid=rids[i],
                input_ids=ids,
                sampling=config,
                max_new_tokens=min(config.max_new_tokens, context_length - len(ids)),
                return_logprob=bool(flags[i]),
                return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                generator=generator,
                stop_window=stop_window,
            )
        )
    return ParsedGenerate(requests, is_batch)


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
