"""SGLang's `/generate` answer for one request: `{"text", "output_ids", "meta_info"}`.

The same builder serves the final answer and every streamed chunk (streaming.py): a chunk reports
the first `num_output` tokens (what the scheduler has fully recorded, `EngineRequest.progress`),
with SGLang's cumulative (non-incremental) text, ids and log-probs. `meta_info` carries SGLang
0.5.23's keys, plus `weight_versions` spans (current SGLang main): which weight version produced
which output tokens. A finished request that asked for `return_routed_experts` (engine started with
`--enable-return-routed-experts`) gets `meta_info["routed_experts"]` as SGLang sends it: positions
`[routed_experts_start_len, seqlen - 1)`, base64 int32 (routing_capture.py).
"""

from __future__ import annotations

from typing import Any

from megatron_sao.cpu_engine.logprobs import meta_entries
from megatron_sao.cpu_engine.request import EngineRequest
from megatron_sao.cpu_engine.stops import output_text, partial_text
from megatron_sao.rollout.routing import encode_sglang_routed_experts


def build_output(req: EngineRequest, tokenizer, current_version: str, num_output: int | None = None,
                 finished: bool = True) -> dict[str, Any]:
    """The answer after `num_output` tokens (all when None); `finished` only when the request is."""
    num = len(req.output_ids) if num_output is None else num_output
    ids = req.output_ids[:num]
    spans = _spans(req, current_version, num)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason if finished else None,
        "prompt_tokens": len(req.input_ids),
        "weight_version": spans[-1]["version"],
        "num_retractions": 0,
    }
    if req.logprobs is not None:
        entries = list(zip(req.output_logprobs[:num], ids, strict=True))
        meta.update(meta_entries(req.logprobs, entries, num, _texts(req, tokenizer)))
    meta.update({
        "reasoning_tokens": 0,
        "completion_tokens": num,
        "cached_tokens": 0,
        "weight_versions": spans,
    })
    if finished:
        meta["e2e_latency"] = req.finished_at - req.created_at
        routed = _routed_experts(req)
        if routed is not None:
            meta["routed_experts"] = routed
    if finished:
        text = output_text(ids, req.finish_reason, req.sampling, tokenizer)
    else:
        text = partial_text(ids, req.sampling, tokenizer)
    out: dict[str, Any] = {"text": text, "output_ids": list(ids), "meta_info": meta}
    if req.return_prompt_token_ids:
        out["prompt_token_ids"] = list(req.input_ids)
    return out


def _routed_experts(req: EngineRequest) -> str | None:
    """SGLang's `meta_info["routed_experts"]` (None when not asked, not captured, or never prefilled:
    SGLang then sends no key either)."""
    if req.routing is None or req.routed_experts_start_len is None:
        return None
    end = len(req.input_ids) + len(req.output_ids) - 1
    rows = req.routing.rows(min(req.routed_experts_start_len, max(end, 0)), end)
    return None if rows is None else encode_sglang_routed_experts(rows)


def _spans(req: EngineRequest, current_version: str, num: int) -> list[dict[str, Any]]:
    """`weight_version_spans` cut at `num` tokens (the scheduler may be ahead of a stream)."""
    spans = [dict(s, end=min(s["end"], num)) for s in req.weight_version_spans(current_version) if s["start"] < num]
    return spans or [{"version": req.weight_version_spans(current_version)[0]["version"], "start": 0, "end": 0}]


def _texts(req: EngineRequest, tokenizer):
    """Per-token texts of log-prob entries (`return_text_in_logprobs`), else Nones."""
    if not req.return_text_in_logprobs:
        return lambda ids: [None] * len(ids)
    return lambda ids: [tokenizer.decode([t]) for t in ids]
