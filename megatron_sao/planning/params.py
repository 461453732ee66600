"""Parameter census of a model from its HF `config.json` alone.

The total is, by definition, the parameter count of the causal LM that transformers builds from
that config: the model is instantiated on the meta device (no memory, well under a second even
for 671B) and every named parameter is put into one of the groups recipes freeze and train
(`attention`, `experts`, `router`, `shared_experts`, `dense_mlp`, `embedding`, `norms`, `head`),
per decoder layer, so the memory model can place each layer on its pipeline stage.

transformers does not build multi-token-prediction (MTP) layers; they are counted apart as
`params_mtp`: per MTP layer one more decoder layer shaped like the last one, two RMSNorms on the
embedding and hidden inputs, the 2h -> h projection and the output norm (the embedding and the
LM head are shared with the main model, as in DeepSeek-V3's own 11.5B "unique" count).

Active parameters are what one token uses: everything except the routed experts, plus top-k of
them (shared experts, embedding and LM head included, as the model cards count).
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GROUPS = ("attention", "experts", "router", "shared_experts", "dense_mlp", "embedding", "norms", "head")

# HF parameter name -> group. Norms inside attention (q/k norms, MLA latent norms, the DSA
# indexer's key norm) belong to attention, as in megatron_sao.models.param_groups.
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"\.self_attn\.")),
    ("embedding", re.compile(r"(^|\.)embed_tokens\.")),
    ("head", re.compile(r"(^|\.)lm_head\.")),
    ("norms", re.compile(r"(layernorm|(^|\.)norm)\.")),
    ("shared_experts", re.compile(r"\.mlp\.shared_experts?(_gate)?\.")),
    ("experts", re.compile(r"\.mlp\.experts\.")),
    ("router", re.compile(r"\.mlp\.gate\.")),
    ("dense_mlp", re.compile(r"\.mlp\.")),
)
_LAYER = re.compile(r"\.layers\.(\d+)\.")
# Attention parameters Megatron keeps whole on every tensor-parallel rank: the norms inside
# attention (q/k norms, MLA's latent norms) and the DSA indexer, whose projections megatron-core
# 0.19.2 builds as duplicated linears (`backend.linear()`: TELinear parallel_mode="duplicated").
_TP_REPLICATED = re.compile(r"\.self_attn\.(indexer\.|\w*norm\.)")


def param_group(name: str) -> str:
    for group, pattern in _RULES:
        if pattern.search(name):
            return group
    raise ValueError(f"HF parameter {name!r} matches no parameter group ({', '.join(GROUPS)})")


def _first(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    return default


@dataclass(slots=True)
class ModelCensus:
    """Parameter counts per group and layer, and the shape numbers the memory model needs."""

    architecture: str
    hidden_size: int
    vocab_size: int
    num_heads: int
    qk_head_dim: int
    v_head_dim: int
    kv_cache_elems_per_layer: int
    """Elements cached per token per layer by an inference engine (K and V, or MLA's latent)."""
    kv_heads: int | None
    """Key/value heads a tensor-parallel engine shards the cache over (None: MLA, not sharded)."""
    num_experts: int
    topk: int
    ffn_hidden: int
    moe_ffn_hidden: int
    shared_ffn_hidden: int
    layers: list[dict[str, int]] = field(default_factory=list)
    """Per decoder layer: group -> parameter count."""
    outside: dict[str, int] = field(default_factory=dict)
    """Parameters outside the decoder layers: embedding, head, final norm."""
    tp_replicated: list[int] = field(default_factory=list)
    """Per decoder layer: attention parameters not split over tensor parallel (norms inside
    attention, the DSA indexer)."""
    params_mtp: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def group_total(self, group: str) -> int:
        return sum(layer.get(group, 0) for layer in self.layers) + self.outside.get(group, 0)

    @property
    def params_total(self) -> int:
        return sum(self.group_total(g) for g in GROUPS)

    @property
    def params_active(self) -> int:
        routed = self.group_total("experts")
        inactive = routed - routed * self.topk // self.num_experts if self.num_experts else 0
        return self.params_total - inactive

    @property
    def params_active_without_embedding(self) -> int:
        """Active parameters without the input embedding (DeepSeek-V3's card: 36.6B "including
        0.9B for the output head")."""
        return self.params_active - self.group_total("embedding")

    @property
    def params_active_without_embedding_and_head(self) -> int:
        """Active parameters without the embedding and the LM head (how GLM-4.5's 32B counts)."""
        return self.params_active_without_embedding - self.group_total("head")

    @property
    def value_head(self) -> int:
        return self.hidden_size

    @property
    def critic_total(self) -> int:
        """The critic: the same trunk, the LM head replaced by a hidden -> 1 value head."""
        return self.params_total - self.group_total("head") + self.value_head

    @property
    def critic_active(self) -> int:
        return self.params_active - self.group_total("head") + self.value_head

    def is_moe_layer(self, index: int) -> bool:
        return self.layers[index].get("experts", 0) > 0

    def activation_elems_per_token(self, index: int) -> int:
        """Elements one layer keeps per token for its backward without recomputation, as
        Megatron-Core's layer saves them (checked against the saved tensors of the tiny Qwen3-MoE,
        `tools/bench_long_context.py`):
          attention: the norm's input and output (2h), the q/k/v projection, the rotated q and k
            and the output the (flash) attention keeps with its per-head log-sum-exp, the rotary
            cos / sin (MLA: per head; no [s, s] score tensor);
          MoE: the norm's input and output (2h), router logits and probabilities (2E), per routed
            copy its input and output (2h), the SwiGLU fc1 output (2 ffn) and activation (ffn);
            a shared expert's fc1 output and activation (3 ffn); a dense MLP 2h + 3 ffn."""
        h = self.hidden_size
        kv_heads = self.kv_heads or self.num_heads  # MLA: keys and values per head after up-projection
        q, k = self.num_heads * self.qk_head_dim, kv_heads * self.qk_head_dim
        v, out = kv_heads * self.v_head_dim, self.num_heads * self.v_head_dim
        attn = 2 * h + (q + k + v) + (q + k) + out + self.num_heads + 2 * self.qk_head_dim
        if self.is_moe_layer(index):
            mlp = 2 * h + 2 * self.num_experts + self.topk * (2 * h + 3 * self.moe_ffn_hidden)
            mlp += 3 * self.shared_ffn_hidden
        else:
            mlp = 2 * h + 3 * self.ffn_hidden
        return attn + mlp


REQUIRED_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
"""config.json fields every count needs (positive integers; a multimodal config may hold them in
`text_config`), besides `model_type`."""


def check_required_fields(hf: dict[str, Any], where: str) -> None:
    """ValueError naming `where` (the config.json) and the field that is missing or not a positive integer."""
    text = {**hf, **(hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {})}
    if not isinstance(text.get("model_type"), str):
        raise ValueError(f"{where}: field model_type is {_described(text.get('model_type'))}, expected a string "
                         "such as qwen3_moe")
    for name in REQUIRED_FIELDS:
        value = text.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: field {name} is {_described(value)}, expected a positive integer")


def _described(value: Any) -> str:
    return "missing" if value is None else repr(value)


def load_hf_config(model: Any) -> dict[str, Any]:
    """The HF config dict of `model` (a ModelConfig): its `config.json`, or the tiny config it
    would build, with the recipe's architecture overrides applied."""
    from megatron_sao.models.build import ARCH_OVERRIDES, arch_overrides
    from megatron_sao.models.hf_files import read_config

    path = Path(model.hf_path) if model.hf_path else None
    if path is not None and (path / "config.json").is_file():
        hf = read_config(path)
        check_required_fields(hf, str(path / "config.json"))
    elif model.build_tiny and path is not None:
        from megatron_sao.models.tiny_hf import tiny_hf_config

        hf = tiny_hf_config(model.tiny_family).to_dict()
    else:
        raise ValueError(f"model.hf_path={model.hf_path!r}: no config.json there; `sao plan` needs at least "
                         "the model's config.json (no weights)")
    hf = {**hf, **(hf.get("text_config") or {})}
    for key, value in arch_overrides(model).items():
        hf_key = ARCH_OVERRIDES[key][0]
        if key == "num_experts":  # families spell it differently
            hf_key = next((k for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in hf), hf_key)
        hf[hf_key] = value
    return hf


def _build_meta_model(hf: dict[str, Any]):
    import torch
    import transformers

    kwargs = {k: v for k, v in hf.items() if k not in ("quantization_config", "auto_map", "model_type")}
    if "model_type" not in hf:
        raise ValueError("config.json has no model_type")
    try:
        config = transformers.AutoConfig.for_model(hf["model_type"], **kwargs)
    except ValueError as e:
        raise ValueError(f"transformers {transformers.__version__} does not know model_type "
                         f"{hf['model_type']!r}: {e}") from e
    previous = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            return transformers.AutoModelForCausalLM.from_config(config)
    finally:
        logging.getLogger("transformers").setLevel(previous)


def census_from_hf_config(hf: dict[str, Any]) -> ModelCensus:
    """Count every parameter of the causal LM transformers builds from `hf` (meta device)."""
    model = _build_meta_model(hf)
    num_layers = int(hf["num_hidden_layers"])
    layers: list[dict[str, int]] = [{} for _ in range(num_layers)]
    outside: dict[str, int] = {}
    tp_replicated = [0] * num_layers
    for name, param in model.named_parameters():
        group = param_group(name)
        match = _LAYER.search(name)
        bucket = layers[int(match[1])] if match else outside
        bucket[group] = bucket.get(group, 0) + param.numel()
        if match and group == "attention" and _TP_REPLICATED.search(name):
            tp_replicated[int(match[1])] += param.numel()

    h = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    if hf.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V3, GLM-5)
        qk_head = int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"])
        v_head = int(hf["v_head_dim"])
        kv_elems = int(hf["kv_lora_rank"]) + int(hf["qk_rope_head_dim"]) + int(hf.get("index_head_dim") or 0)
        kv_heads = None
    else:
        qk_head = v_head = int(hf.get("head_dim") or h // heads)
        kv_heads = int(_first(hf, "num_key_value_heads", default=heads))
        kv_elems = 2 * kv_heads * qk_head
    num_experts = int(_first(hf, "num_experts", "n_routed_experts", "num_local_experts", default=0) or 0)
    moe_ffn = int(_first(hf, "moe_intermediate_size", default=0) or 0)
    shared_ffn = int(_first(hf, "shared_expert_intermediate_size", default=0) or 0)
    shared_ffn = shared_ffn or int(hf.get("n_shared_experts") or 0) * moe_ffn

    census = ModelCensus(
        architecture=(hf.get("architectures") or [type(model).__name__])[0],
        hidden_size=h,
        vocab_size=int(hf["vocab_size"]),
        num_heads=heads,
        qk_head_dim=qk_head,
        v_head_dim=v_head,
        kv_cache_elems_per_layer=kv_elems,
        kv_heads=kv_heads,
        num_experts=num_experts,
        topk=int(_first(hf, "num_experts_per_tok", "moe_router_topk", default=0) or 0),
        ffn_hidden=int(_first(hf, "intermediate_size", default=0) or 0),
        moe_ffn_hidden=moe_ffn,
        shared_ffn_hidden=shared_ffn,
        layers=layers,
        outside=outside,
        tp_replicated=tp_replicated,
    )
    num_mtp = int(_first(hf, "num_nextn_predict_layers", "mtp_num_hidden_layers", default=0) or 0)
    if num_mtp and layers:
        per_mtp = sum(layers[-1].values()) + 2 * h + 2 * h * h + h  # layer, enorm+hnorm, eh_proj, norm
        census.params_mtp = num_mtp * per_mtp
    return census
