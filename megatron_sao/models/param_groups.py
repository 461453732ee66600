"""Named parameter groups of a Megatron GPT/MoE model, and which of them train.

Groups are what recipes talk about ("freeze the critic's attention"); Megatron parameter names
are what the code sees. The mapping is by name pattern and is the same under the local and the
Transformer Engine layer specs (TE fuses the input norm into `linear_qkv.layer_norm_weight`,
which is still a norm here).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

GROUPS = ("attention", "experts", "router", "shared_experts", "dense_mlp", "embedding", "norms", "head")

_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("norms", re.compile(r"(layernorm|layer_norm_weight|layer_norm_bias|final_norm)")),
    ("embedding", re.compile(r"(^|\.)embedding\.")),
    ("head", re.compile(r"(^|\.)output_layer\.")),
    ("router", re.compile(r"\.mlp\.router\.")),
    ("shared_experts", re.compile(r"\.mlp\.shared_experts\.")),
    ("experts", re.compile(r"\.mlp\.experts\.")),
    ("attention", re.compile(r"\.self_attention\.")),
    ("dense_mlp", re.compile(r"\.mlp\.")),
)
# q/k norms live inside attention and belong to it (frozen with it); input norms do not.
_ATTENTION_INTERNAL_NORM = re.compile(r"\.self_attention\.(q_layernorm|k_layernorm|kv_layernorm)\.")


def param_group(name: str) -> str:
    """The group of a Megatron parameter name (DDP / Float16Module prefixes are ignored)."""
    if _ATTENTION_INTERNAL_NORM.search(name):
        return "attention"
    for group, pattern in _RULES:
        if pattern.search(name):
            return group
    raise ValueError(f"parameter {name!r} matches no parameter group; known groups: {', '.join(GROUPS)}")


def _selects(spec: str, name: str, group: str) -> bool:
    if spec == "all":
        return True
    if spec.startswith("re:"):
        return re.search(spec[3:], name) is not None
    # The config vocabulary says "experts" for routed experts and "mlp" does not exist; dense MLP
    # layers (e.g. DeepSeek's first layers) are selected by name.
    return spec == group


def resolve_trainable(name: str, trainable: Iterable[str], frozen: Iterable[str]) -> bool:
    """Whether parameter `name` trains under a role's `trainable` / `frozen` lists (frozen wins)."""
    group = param_group(name)
    if any(_selects(s, name, group) for s in frozen):
        return False
    return any(_selects(s, name, group) for s in trainable)


@dataclass(slots=True)
class GroupCount:
    trainable: int = 0
    frozen: int = 0


def apply_trainable(model_chunks: Iterable[torch.nn.Module], trainable: Iterable[str],
                    frozen: Iterable[str]) -> dict[str, GroupCount]:
    """Set `requires_grad` on every parameter; return element counts per group (this rank)."""
    trainable, frozen = list(trainable), list(frozen)
    counts = {g: GroupCount() for g in GROUPS}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            train = resolve_trainable(name, trainable, frozen)
            param.requires_grad_(train)
            count = counts[param_group(name)]
            if train:
                count.trainable += param.numel()
            else:
                count.frozen += param.numel()
    return counts


def format_param_table(role: str, counts: dict[str, GroupCount]) -> str:
    """A fixed-width table of trainable / frozen parameter counts per group."""
    lines = [f"{role} parameters (this rank)", f"{'group':<16}{'trainable':>14}{'frozen':>14}"]
    total = GroupCount()
    for group in GROUPS:
        c = counts[group]
        if c.trainable or c.frozen:
            lines.append(f"{group:<16}{c.trainable:>14,}{c.frozen:>14,}")
            total.trainable += c.trainable
            total.frozen += c.frozen
    lines.append(f"{'total':<16}{total.trainable:>14,}{total.frozen:>14,}")
    return "\n".join(lines)
