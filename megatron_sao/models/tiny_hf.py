"""Tiny, randomly initialised HuggingFace checkpoints built locally (no downloads).

Tests, benchmarks and the CPU demo need a real HF model directory (config.json, safetensors
weights, a tokenizer with a chat template) of the same *family* as the production models, only
small. Nothing may be downloaded at run time, so the tokenizer is built here too: a byte-level
BPE with no merges (every UTF-8 byte is one token) plus the chat special tokens, which round-trips
any text exactly and keeps the vocabulary tiny.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# Chat special tokens (Qwen-style). Order fixes their ids: they follow the 256 byte tokens.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
NUM_BYTE_TOKENS = 256
TINY_VOCAB_SIZE = 320  # 256 bytes + specials, padded to a multiple of 64 (TP-divisible)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Per family: the transformers config class name and tiny sizes that keep every parallel layout
# used in tests (TP2, EP2, PP2) valid: heads, query groups and experts divisible by 2, an even
# number of layers.
_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "config_class": "Qwen3MoeConfig",
        "kwargs": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            # 32K: recorded trajectories up to rollout.max_total_tokens=32768 train on the tiny recipe
            # (RoPE has no position table: the weights are the same as with 4096).
            "max_position_embeddings": 32768,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "router_aux_loss_coef": 0.0,
        },
    },
    "glm4_moe": {
        # GLM-4.5 (355B-A32B) shape: qkv bias, q/k norm, partial rotary, shared expert, sigmoid router
        # with expert-score correction bias, first layer dense.
        "config_class": "Glm4MoeConfig",
        "kwargs": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": True,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    },
    "deepseek_v3": {
        # DeepSeek-V3 (671B) shape: MLA with q LoRA, shared expert, grouped sigmoid router with
        # correction bias, first layer dense.
        "config_class": "DeepseekV3Config",
        "kwargs": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "max_position_embeddings": 4096,
            # YaRN as in the real checkpoint (factor 40 over 4096 there; 32 x 128 = 4096 here).
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
                                "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            "rope_interleave": True,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
    },
    "glm_moe_dsa": {
        # GLM-5 (744B-A40B) shape: MLA + DeepSeek sparse-attention indexer, shared expert, first
        # layer dense.
        "config_class": "GlmMoeDsaConfig",
        "kwargs": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "index_topk": 8,
            "index_head_dim": 16,
            "index_n_heads": 2,
            # The real GLM-5 config has indexer_rope_interleave=true and rms_norm_eps=1e-5, where
            # transformers 5.12.1 departs from its own config (its indexer always rotates
            # half-split, its q/kv latent norms always use eps 1e-6) while Megatron-Core follows
            # it (as vLLM and SGLang do). These two values are the ones on which the HF model is
            # a valid logits reference; weight conversion does not depend on them.
            "indexer_rope_interleave": False,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
    },
}


def supported_families() -> list[str]:
    return sorted(_FAMILIES)


def build_tiny_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """A byte-level tokenizer: 256 byte tokens (no merges) + `SPECIAL_TOKENS`, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = sorted(ByteLevel.alphabet())
    assert len(byte_alphabet) == NUM_BYTE_TOKENS
    vocab = {ch: i for i, ch in enumerate(byte_alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 1 << 20
    return tok


def tiny_hf_config(family: str = "qwen3_moe", **overrides: Any):
    """The transformers config of a tiny model of `family`; `overrides` replace config fields."""
    import transformers

    if family not in _FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; supported: {supported_families()}")
    spec = _FAMILIES[family]
    config_cls = getattr(transformers, spec["config_class"])
    special_ids = {name: NUM_BYTE_TOKENS + i for i, name in enumerate(SPECIAL_TOKENS)}
    kwargs = {
        **spec["kwargs"],
        "vocab_size": TINY_VOCAB_SIZE,
        "bos_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": special_ids["<|im_end|>"],
        "pad_token_id": special_ids["<|endoftext|>"],
        **overrides,
    }
    config = config_cls(**kwargs)
    config.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
    return config


def build_tiny_hf_checkpoint(
    out_dir: str | Path,
    family: str = "qwen3_moe",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random HF checkpoint (config, safetensors, tokenizer) of `family` to `out_dir`.

    Deterministic in `seed`. Returns the directory. Used by tests, benchmarks and the CPU demo.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_hf_config(family, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out)
    (out / "sao_tiny.json").write_text(json.dumps({"family": family, "seed": seed}) + "\n")
    return out
