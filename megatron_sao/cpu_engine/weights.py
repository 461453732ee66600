"""In-place weight updates of the CPU engine's model, addressed by HF checkpoint names.

transformers 5 fuses some checkpoint tensors when it loads a model (a Qwen3-MoE layer's
per-expert `experts.{i}.gate_proj.weight` / `up_proj.weight` become one
`experts.gate_up_proj` parameter). Trainers and megatron-bridge speak checkpoint names, and a
weight bucket may hold a single expert's tensor, so the engine needs checkpoint-named handles on
the live parameters. `revert_weight_conversion` (what `save_pretrained` uses) produces exactly
those, and for the conversions in use (merge / concatenate / transpose) its outputs are views of
the parameters: copying into a view writes the parameter. `HFWeightMap` builds the views once and
checks that each really shares a parameter's storage; a name whose reverted tensor is a copy
cannot be updated in place and is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch


class HFWeightMap:
    def __init__(self, model: torch.nn.Module) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        state = dict(model.state_dict())
        reverted = revert_weight_conversion(model, state)
        live = {t.untyped_storage().data_ptr() for t in state.values()}
        self.views: dict[str, torch.Tensor] = {}
        self.not_views: list[str] = []
        for name, tensor in reverted.items():
            if tensor.untyped_storage().data_ptr() in live:
                self.views[name] = tensor
            else:
                self.not_views.append(name)
        # Names that alias one storage region (tied embeddings): any one of them covers the rest.
        self._alias_groups: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
        for name, view in self.views.items():
            key = (view.untyped_storage().data_ptr(), view.storage_offset(), tuple(view.shape))
            self._alias_groups.setdefault(key, []).append(name)

    @property
    def names(self) -> list[str]:
        return sorted(self.views)

    def check(self, named: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError (before anything is written) for unknown names or wrong shapes."""
        refused = sorted(set(named) & set(self.not_views))
        if refused:
            raise NotImplementedError(
                f"the CPU engine cannot update {refused[:5]} in place: transformers stores them as a "
                "conversion that is not a view of the live parameters"
            )
        unknown = sorted(set(named) - set(self.views))
        if unknown:
            raise ValueError(f"{len(unknown)} tensor name(s) unknown to the model, e.g. {unknown[:5]}")
        for name, tensor in named.items():
            if tuple(tensor.shape) != tuple(self.views[name].shape):
                expected = tuple(self.views[name].shape)
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model has {expected}")

    def missing_from(self, named: Mapping[str, torch.Tensor]) -> list[str]:
        """Model tensors a full checkpoint `named` does not cover (aliases count as covered)."""
        missing = []
        for group in self._alias_groups.values():
            if not any(name in named for name in group):
                missing.extend(group)
        return sorted(missing + [n for n in self.not_views if n not in named])

    @torch.no_grad()
    def copy_(self, named: Mapping[str, torch.Tensor]) -> None:
        self.check(named)
        for name, tensor in named.items():
            self.views[name].copy_(tensor)


def read_hf_checkpoint(model_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory (sharded or not)."""
    from safetensors.torch import load_file

    root = Path(model_path)
    if not root.is_dir():
        raise ValueError(f"model_path {str(root)!r} is not a directory")
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(root)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for filename in files:
        tensors.update(load_file(str(root / filename)))
    return tensors
