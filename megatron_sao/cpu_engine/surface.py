"""The request-level fields of SGLang's `/generate` body (sglang 0.5.23 `GenerateReqInput`) and what
the CPU engine does with each.

Three kinds: fields the engine honours (parsed in protocol.py); metadata that changes nothing on a
single CPU engine (routing, tracing, logging, cache keys: there is no prefix cache), accepted when
well-typed; and features a CPU engine cannot provide (multimodal inputs, LoRA, custom logit
processors, hidden states, disaggregation, ...), accepted at their default value only and refused
otherwise with a 400 naming the field. Any other field is refused as unknown, so a typo is not
silently ignored.
"""

from __future__ import annotations

from typing import Any

from megatron_sao.cpu_engine.sampling_params import is_default

HONOURED = frozenset({
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "token_ids_logprob", "return_text_in_logprobs", "stream", "return_prompt_token_ids",
    "return_routed_experts", "routed_experts_start_len",
})

_STR, _INT, _BOOL, _OBJ, _NUM = (str,), (int,), (bool,), (dict,), (int, float)
_STR_OR_LIST = (str, list)
METADATA: dict[str, tuple[type, ...]] = {
    "session_id": _STR,
    "log_metrics": _BOOL,
    "no_logs": _BOOL,
    "priority": _INT,
    "custom_labels": _OBJ,
    "routing_key": _STR,
    "conversation_id": _STR,
    "extra_key": _STR_OR_LIST,
    "cache_salt": _STR_OR_LIST,
    "external_trace_header": _OBJ,
    "received_time": _NUM,
}
"""Accepted (type-checked) and without effect on this engine."""

DEFAULT_ONLY: dict[str, Any] = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None, "mm_hashes": None,
    "mm_content_hashes": None, "use_audio_in_video": False, "video_config": None, "modalities": None,
    "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None, "mm_processor_kwargs": None,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None,
    "watermark": None,
    "return_sampling_mask": False, "sampling_logprobs_mode": None, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False,
    "return_hidden_states": False,
    "return_indexer_topk": False, "return_entropy": False, "return_bytes": False,
    "session_params": None, "lora_path": None, "lora_id": None, "custom_logit_processor": None,
    "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "routed_dp_rank": 0, "data_parallel_rank": 0, "disagg_prefill_dp_rank": None,
    "http_worker_ipc": None, "background": False, "require_reasoning": False, "max_thinking_tokens": None,
    "multi_item_delimiter_indices": None, "token_indices_to_pool": None, "kv_hints": None,
}
"""Features a CPU engine cannot provide: their default (null, false, empty; rank 0 for the
data-parallel rank fields: this engine is rank 0 of one) passes, anything else is a 400."""

GENERATE_FIELDS = HONOURED | set(METADATA) | set(DEFAULT_ONLY)


def check_request_fields(body: dict[str, Any]) -> None:
    """Refuse unknown fields, mistyped metadata and non-default values of unsupported features,
    naming the field (ValueError: a 400)."""
    unknown = sorted(str(k) for k in body if k not in GENERATE_FIELDS)
    if unknown:
        raise ValueError(f"unknown request field(s) {unknown[:10]}")
    for name, default in DEFAULT_ONLY.items():
        if not is_default(body.get(name), default):
            raise ValueError(f"request field {name}={_short(body[name])} is not supported by the CPU engine "
                             "(only its default is accepted)")
    for name, kinds in METADATA.items():
        value = body.get(name)
        if value is None:
            continue
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise ValueError(f"{name} must be {' or '.join(_KIND_NAMES[k] for k in kinds)}, got {_short(value)}")
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise ValueError(f"{name} must be a string or a list of strings, got {_short(value)}")
        if name == "custom_labels" and not all(isinstance(v, str) for v in value.values()):
            raise ValueError(f"custom_labels values must be strings, got {_short(value)}")


_KIND_NAMES = {str: "a string", int: "an integer", bool: "true or false", dict: "a JSON object",
               float: "a number", list: "a list of strings"}


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
