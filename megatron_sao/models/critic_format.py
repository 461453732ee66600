"""The HF format of a critic (value model): a token-classification checkpoint with one label.

A critic is the actor's trunk with a scalar value head instead of the LM head. Its HF export is
what transformers (and verl/OpenRLHF critics) call `<Family>ForTokenClassification` with
`num_labels=1`:

- tensors: the trunk exactly as in the causal LM (`model.*`), no `lm_head.weight`, plus
  `score.weight` [1, hidden] (= Megatron `output_layer.weight` of the critic) and `score.bias` [1],
  always zero (megatron-sao's value head has no bias; a non-zero bias is refused on import);
- config.json: the causal LM's config with `architectures = ["<Family>ForTokenClassification"]`,
  `num_labels = 1` and a `sao_critic` block naming the causal architecture and this format.

`AutoModelForTokenClassification.from_pretrained(dir)` then returns V(state) as `logits[..., 0]`
for families transformers has that class for (Qwen3-MoE, DeepSeek-V3); for GLM-4.5 / GLM-5 it has
none, the files are the same and megatron-sao reads them. Import of such a directory builds the
critic trunk through megatron-bridge from a causal-LM view of it (`causal_view`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CRITIC_FORMAT = "sao-critic-v1"
VALUE_WEIGHT = "score.weight"
VALUE_BIAS = "score.bias"
LM_HEAD = "lm_head.weight"
_CRITIC_KEYS = ("sao_critic", "num_labels", "id2label", "label2id")


def is_critic_config(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    return "sao_critic" in config or bool(archs and archs[0].endswith("ForTokenClassification")
                                          and len(config.get("id2label") or {0: 0}) == 1)


def causal_architecture(config: dict[str, Any]) -> str:
    if "sao_critic" in config:
        return config["sao_critic"]["causal_lm_architecture"]
    arch = (config.get("architectures") or [""])[0]
    return arch.replace("ForTokenClassification", "ForCausalLM")


def causal_config(config: dict[str, Any]) -> dict[str, Any]:
    """The causal-LM config behind a critic config (unchanged if it already is one)."""
    if not is_critic_config(config):
        return dict(config)
    out = {k: v for k, v in config.items() if k not in _CRITIC_KEYS}
    out["architectures"] = [causal_architecture(config)]
    return out


def critic_config(config: dict[str, Any]) -> dict[str, Any]:
    """The critic (token-classification, one label) config of a causal-LM config."""
    if is_critic_config(config):
        return dict(config)
    causal_arch = config["architectures"][0]
    out = dict(config)
    out["architectures"] = [causal_arch.replace("ForCausalLM", "ForTokenClassification")]
    out["num_labels"] = 1
    out["id2label"] = {"0": "value"}
    out["label2id"] = {"value": 0}
    out["sao_critic"] = {
        "format": CRITIC_FORMAT,
        "causal_lm_architecture": causal_arch,
        "value_head": VALUE_WEIGHT,
        "note": "score.bias is always zero; logits[..., 0] at position t is V(state after token t)",
    }
    return out


def critic_hf_shapes(causal_shapes: dict[str, tuple[int, ...]], hidden_size: int) -> dict[str, tuple[int, ...]]:
    """The HF tensor shapes of a critic given its causal LM's."""
    out = {k: v for k, v in causal_shapes.items() if k != LM_HEAD}
    out[VALUE_WEIGHT] = (1, hidden_size)
    out[VALUE_BIAS] = (1,)
    return out


def causal_view(source: Path, config: dict[str, Any], view: Path) -> Path:
    """Make `view` a directory that looks like the causal LM of `source`: config.json rewritten to
    the causal form, every other file of `source` symlinked. megatron-bridge only accepts causal LMs."""
    view.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        if entry.name != "config.json" and entry.is_file():
            os.symlink(entry.resolve(), view / entry.name)
    (view / "config.json").write_text(json.dumps(causal_config(config), indent=2) + "\n")
    return view
