"""The HF side of `sao convert verify` without the whole HF model on any rank.

The HF model is built on the meta device (no memory), and its forward runs unit by unit: the
embedding, each decoder layer, the final norm and the LM head. The decoder layers are split into
contiguous blocks over the ranks, like a pipeline; the embedding goes with the first block, the
norm and LM head with the last. Just before a unit runs, its owner reads that unit's tensors from
the safetensors files (only those) and loads them through transformers' own checkpoint
conversion (expert fusing and renames stay transformers' business); right after, it frees them
and broadcasts the unit's output to every rank. The other ranks skip the unit's compute and take
the broadcast. Peak memory per rank is therefore one unit's weights plus activations, on one
rank or many, and the outputs are those of the whole model (same modules, same ops).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_sao.models.hf_files import inspect_hf_checkpoint
from megatron_sao.platform.collective import broadcast_tensor


def _rank_and_size() -> tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _no_transformers_progress() -> Iterator[None]:
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


class StreamedHFModel:
    """An HF checkpoint's model (`base=True`: the trunk without LM head, as `AutoModel`) whose
    forward streams its weights unit by unit and shards the units over the ranks (see module
    docstring). Collective: every rank calls `forward` with the same tokens."""

    def __init__(self, hf_dir: Path, config_dir: Path | None = None, base: bool = False) -> None:
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping

        self.hf_dir = Path(hf_dir)
        config = transformers.AutoConfig.from_pretrained(str(config_dir or hf_dir))
        with torch.device("meta"):
            auto = transformers.AutoModel if base else transformers.AutoModelForCausalLM
            self.model = auto.from_config(config, dtype=torch.float32).eval()
        self._real_non_persistent_buffers()
        self.mapping = get_model_conversion_mapping(self.model)
        tensors = inspect_hf_checkpoint(self.hf_dir).tensors
        self.files = {name: self.hf_dir / info.file for name, info in tensors.items()}
        self.rank, self.world = _rank_and_size()
        self.loaded_units: list[str] = []
        """Units this rank materialised, in order (what the sharding put on it)."""
        self._install_hooks()

    # ---- setup -------------------------------------------------------------------------------

    def _real_non_persistent_buffers(self) -> None:
        """Rotary tables are computed at construction and never stored: rebuild those modules on CPU."""
        for name, module in self.model.named_modules():
            meta = [b for b, t in module.named_buffers(recurse=False)
                    if t.is_meta and b in module._non_persistent_buffers_set]
            if not meta:
                continue
            try:
                with torch.device("cpu"):
                    fresh = type(module)(config=getattr(module, "config", self.model.config))
            except TypeError as error:
                raise ValueError(f"{self.hf_dir}: cannot compute the buffers {meta} of {name} "
                                 f"({type(module).__name__}) for a streamed forward: {error}") from error
            for buffer in meta:
                module._buffers[buffer] = fresh._buffers[buffer].float()

    def units(self) -> list[tuple[str, torch.nn.Module]]:
        """(full module name, module) in forward order, each with its owner decided by `owner`."""
        base = self.model.base_model
        prefix = "" if base is self.model else f"{self.model.base_model_prefix}."
        layers = [(f"{prefix}layers.{i}", layer) for i, layer in enumerate(base.layers)]
        first = [(f"{prefix}{n}", m) for n, m in base.named_children()
                 if n != "layers" and any(True for _ in m.parameters()) and n != "norm"]
        last = [(f"{prefix}{n}", m) for n, m in base.named_children() if n == "norm"]
        last += [(n, m) for n, m in self.model.named_children()
                 if m is not base and any(True for _ in m.parameters())]
        return first + layers + last

    def owners(self) -> dict[str, int]:
        units = self.units()
        layers = [n for n, _ in units if ".layers." in f".{n}" and n.rsplit(".", 1)[-1].isdigit()]
        per_rank = -(-len(layers) // self.world) if layers else 1
        owner = {n: min(i // per_rank, self.world - 1) for i, n in enumerate(layers)}
        last_owner = max(owner.values(), default=0)
        seen_layer = False
        for name, _ in units:
            if name in owner:
                seen_layer = True
            else:
                owner[name] = last_owner if seen_layer else 0
        return owner

    def _install_hooks(self) -> None:
        owners = self.owners()
        for name, module in self.units():
            owner = owners[name]
            if owner == self.rank:
                module.register_forward_pre_hook(lambda m, args, n=name: self._materialise(n, m))
            else:
                module.forward = self._placeholder
            module.register_forward_hook(lambda m, args, out, n=name, o=owner: self._finish(n, m, out, o))

    @staticmethod
    def _placeholder(*args: Any, **kwargs: Any) -> None:
        """A non-owner's stand-in for a unit: computes nothing; the forward hook replaces its
        output by the owner's broadcast."""
        return None

    # ---- per unit ----------------------------------------------------------------------------

    def _sources(self, unit: str) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        alternatives = (unit + ".", f"{self.model.base_model_prefix}.{unit}.")
        names = [n for n in self.files if n.startswith(alternatives)]
        if not names and unit == "lm_head" and getattr(self.model.config, "tie_word_embeddings", False):
            names = [n for n in self.files if n.endswith("embed_tokens.weight")]
        tensors = {}
        for name in names:
            with safe_open(str(self.files[name]), framework="pt") as f:
                tensors[name] = f.get_tensor(name)
        return tensors

    def _materialise(self, unit: str, module: torch.nn.Module) -> None:
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        sources = self._sources(unit)
        if unit == "lm_head" and sources and all(n.endswith("embed_tokens.weight") for n in sources):
            module.weight = torch.nn.Parameter(next(iter(sources.values())).float(), requires_grad=False)
        else:
            load = LoadStateDictConfig(dtype=torch.float32, weight_mapping=self.mapping, device_map={"": "cpu"})
            with _no_transformers_progress():
                convert_and_load_state_dict_in_model(self.model, sources, load, None)
        persistent = set(module.state_dict(keep_vars=True))
        unset = [n for n, t in module.state_dict(keep_vars=True).items() if t.is_meta and n in persistent]
        if unset:
            raise ValueError(f"{self.hf_dir}: no tensors for {unit}.{unset[0]} (and {len(unset) - 1} more) in the "
                             "checkpoint files")
        self.loaded_units.append(unit)

    def _finish(self, unit: str, module: torch.nn.Module, out: Any, owner: int) -> Any:
        if owner == self.rank:
            for sub in module.modules():
                for name, param in list(sub._parameters.items()):
                    if param is not None:
                        sub._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="meta"),
                                                                   requires_grad=False)
                for name, buffer in list(sub._buffers.items()):
                    if buffer is not None and name not in sub._non_persistent_buffers_set:
                        sub._buffers[name] = torch.empty_like(buffer, device="meta")
        if self.world == 1:
            return out
        return self._broadcast_output(unit, out, owner)

    def _broadcast_output(self, unit: str, out: Any, owner: int) -> Any:
        """The owner's output (a tensor, or a tuple of tensors / None: GLM-5's layers also return
        the indexer's top-k) on every rank: its structure as an object, then each tensor."""
        items = out if isinstance(out, tuple) else (out,)
        layout = None
        if owner == self.rank:
            if any(i is not None and not isinstance(i, torch.Tensor) for i in items):
                raise TypeError(f"{unit} returned {type(out).__name__} with non-tensor items; the streamed "
                                "forward broadcasts tensors only")
            layout = [isinstance(out, tuple), [None if i is None else (tuple(i.shape), i.dtype) for i in items]]
        box = [layout]
        torch.distributed.broadcast_object_list(box, src=owner)
        is_tuple, metas = box[0]
        received = []
        for position, meta in enumerate(metas):
            if meta is None:
                received.append(None)
                continue
            mine = items[position] if owner == self.rank else None
            received.append(broadcast_tensor(mine, owner, meta[0], meta[1]))  # the HF units run on the host
        return tuple(received) if is_tuple else received[0]

    def forward(self, tokens_bt: torch.Tensor) -> torch.Tensor:
        """Logits (causal LM) or last hidden state (base), float32, the same on every rank."""
        with torch.no_grad():
            out = self.model(tokens_bt, use_cache=False)
        return (out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state).float()
