"""The model families conversion supports, and the check that a checkpoint is one of them.

Support means: megatron-bridge 0.6.2 has a bridge for the architecture, and a tiny random
checkpoint of the family (built with the installed transformers 5.12.1) converts HF -> mcore ->
HF bit-exactly under TP1/TP2/EP2/PP2 and gives HF-equal logits (tests/checkpointing). Anything
else is refused before any work starts, with this list in the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Family:
    architecture: str
    """`architectures[0]` of the HF config.json."""
    tiny_family: str
    """`megatron_sao.models.tiny_hf` family used to test it."""
    models: str
    """The production checkpoints of the shipped recipes in this family."""
    note: str = ""
    """What to know when converting it (shown by `sao convert --help` and in docs/conversion.md)."""


FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        Family("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3-30B-A3B(-Thinking-2507), Qwen3-235B-A22B"),
        Family("Glm4MoeForCausalLM", "glm4_moe", "GLM-4.5 (355B-A32B)",
               "the multi-token-prediction layer (model.layers.92) is carried through unchanged, not trained"),
        Family("DeepseekV3ForCausalLM", "deepseek_v3", "DeepSeek-V3 (671B, MLA)",
               "bf16 checkpoints only (the official FP8 one must be cast to bf16 first); the MTP layer "
               "(model.layers.61) is carried through unchanged"),
        Family("GlmMoeDsaForCausalLM", "glm_moe_dsa", "GLM-5 (744B-A40B, MLA + DSA)",
               "weights convert exactly; transformers 5.12.1 ignores config.indexer_rope_interleave and "
               "uses eps 1e-6 for the q/kv latent norms, Megatron-Core (like vLLM/SGLang) follows the config, "
               "so HF-vs-Megatron logits agree only where those coincide (see docs/conversion.md)"),
    )
}


def supported_architectures() -> list[str]:
    return sorted(FAMILIES)


def family_of(config: dict[str, Any], where: str) -> Family:
    """The supported family of an HF config (a causal LM's, or the causal LM behind a critic's)."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    critic_of = (config.get("sao_critic") or {}).get("causal_lm_architecture")
    if critic_of:
        arch = critic_of
    elif arch and arch.endswith("ForTokenClassification"):
        arch = arch.removesuffix("ForTokenClassification") + "ForCausalLM"
    if arch not in FAMILIES:
        shown = arch or f"none (model_type={config.get('model_type')!r})"
        raise ValueError(f"{where}: unsupported architecture {shown}; supported: "
                         f"{', '.join(supported_architectures())} (docs/conversion.md#families)")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise NotImplementedError(
            f"{where}: quantized checkpoint ({method}); conversion reads bf16/fp16/fp32 weights only: "
            "dequantize it first (issue 4, docs/conversion.md#families)"
        )
    return FAMILIES[arch]
