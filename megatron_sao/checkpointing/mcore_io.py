"""Save and load a model's weights as a torch_dist checkpoint with layout- and spec-free keys.

torch_dist keys are global tensor names, so one checkpoint loads into any TP/PP/EP layout. They
also depend on the layer spec: with Transformer Engine, norms feeding a linear layer are fused
into it (`linear_qkv.layer_norm_weight`), while the local (CPU) spec keeps separate norm modules.
Megatron-Core maps most local names onto the TE ones, but not all (MoE layers' pre-MLP norm;
MLA's q/kv latent norms; MLA dense layers' pre-MLP norm). `model_state` renames those keys to
the names the Transformer Engine spec uses, so a checkpoint written on CPU loads into a GPU model
and back. Training must save and load model weights through `save_model` / `load_model` (or
`model_state`) for that to hold.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_sao.checkpointing.fill_tracker import FillTracker
from megatron_sao.checkpointing.model_setup import unwrap
from megatron_sao.checkpointing.writeback import DEFAULT_IO_BUCKET_BYTES

if TYPE_CHECKING:
    from megatron_sao.checkpointing.dist_reader import BackgroundLoad
    from megatron_sao.checkpointing.distcp_stream import FileDigests
    from megatron_sao.checkpointing.load_window import LoadWindow

OnBytes = Callable[[int], None]

# TE name of each separately-built norm, by (layer context). Values are key fragments before
# "weight"/"bias"; the local spec may already have renamed some (listed as known aliases).
_QKV_FUSED = "self_attention.linear_qkv.layer_norm_"
_FC1_FUSED = "mlp.linear_fc1.layer_norm_"
_Q_UP_FUSED = "self_attention.linear_q_up_proj.layer_norm_"
_KV_UP_FUSED = "self_attention.linear_kv_up_proj.layer_norm_"
_KNOWN_FRAGMENTS = ("input_layernorm.", "pre_mlp_layernorm.", "self_attention.q_layernorm.",
                    "self_attention.kv_layernorm.", _QKV_FUSED, _FC1_FUSED, _Q_UP_FUSED, _KV_UP_FUSED)


def _is_norm(module: Any) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return module is not None and not isinstance(module, IdentityOp) and any(True for _ in module.parameters())


def _te_fragments(layer: Any) -> dict[str, str]:
    """local module path (within the layer) -> the TE key fragment it must be saved under."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    out = {}
    attention = layer.self_attention
    if isinstance(attention, SelfAttention) and _is_norm(layer.input_layernorm):
        out["input_layernorm."] = _QKV_FUSED
    if _is_norm(getattr(layer, "pre_mlp_layernorm", None)):
        out["pre_mlp_layernorm."] = "pre_mlp_layernorm." if isinstance(layer.mlp, MoELayer) else _FC1_FUSED
    if isinstance(attention, MLASelfAttention):
        if _is_norm(getattr(attention, "q_layernorm", None)):
            out["self_attention.q_layernorm."] = _Q_UP_FUSED
        if _is_norm(getattr(attention, "kv_layernorm", None)):
            out["self_attention.kv_layernorm."] = _KV_UP_FUSED
    return out


def _retarget(key: str, param: str, target: str) -> str:
    for fragment in _KNOWN_FRAGMENTS:
        if key.endswith(fragment + param):
            return key[: -len(fragment + param)] + target + param
    raise AssertionError(f"unexpected norm key {key!r}")


def canonical_sharded_state_dict(chunk: torch.nn.Module) -> dict[str, Any]:
    """The sharded state of `chunk` (DDP / Float16Module wrappers looked through: their keys are
    prefixed) with norm keys named as under the Transformer Engine spec."""
    model = unwrap(chunk)
    state = model.sharded_state_dict()
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return state
    for index, layer in enumerate(decoder.layers):
        for local, target in _te_fragments(layer).items():
            for param in ("weight", "bias"):
                entry = state.get(f"decoder.layers.{index}.{local}{param}")
                if entry is not None:
                    entry.key = _retarget(entry.key, param, target)
    return state


def model_state(chunks: list[torch.nn.Module]) -> dict[str, dict[str, Any]]:
    """The sharded state of a role's model chunks, in Megatron's `model` / `model<i>` convention."""
    if len(chunks) == 1:
        return {"model": canonical_sharded_state_dict(chunks[0])}
    return {f"model{i}": canonical_sharded_state_dict(chunk) for i, chunk in enumerate(chunks)}


def save_model(chunks: list[torch.nn.Module], directory: Path, thread_count: int = 2,
               bucket_bytes: int = DEFAULT_IO_BUCKET_BYTES, on_bytes: OnBytes | None = None,
               on_planned: OnBytes | None = None, fill: Callable[[], None] | None = None,
               tracker: FillTracker | None = None, release_written: bool = False) -> dict[str, tuple[int, str]]:
    """Collective: write the chunks' weights as a torch_dist checkpoint into existing `directory`.

    `thread_count` writer threads per rank (each writes and hashes one file; 2 overlap hashing and
    serialising with the disk on a 2-core host); at most `bucket_bytes` of staged copies at a time
    (`dist_writer`); `on_planned(bytes this rank writes)`, then `on_bytes(n)` per tensor written.
    With `fill` (and the `tracker` it reports to), the weights are written while `fill` fills them:
    `fill` runs on this thread after the save is planned (see `dist_writer`). With `release_written`
    (and a tracker), each tracked tensor's memory goes back to the OS once written
    (`page_release`): the chunks' weights read as zeros afterwards.
    Returns {file name: (bytes, digest hex)} of the .distcp files this rank wrote."""
    from megatron.core import dist_checkpointing

    from megatron_sao.checkpointing.dist_writer import BoundedSaveStrategy

    strategy = BoundedSaveStrategy(thread_count=thread_count, bucket_bytes=bucket_bytes, on_bytes=on_bytes,
                                   on_planned=on_planned, fill=fill, tracker=tracker,
                                   release_written=release_written)
    dist_checkpointing.save(model_state(chunks), str(directory), sharded_strategy=strategy)
    return strategy.files


def load_model(chunks: list[torch.nn.Module], directory: Path, on_bytes: OnBytes | None = None) -> None:
    """Collective: load weights saved by `save_model` (any layout, either spec) into `chunks`, in
    place (no second copy of any tensor; `dist_reader.merge_in_place`); `on_bytes(n)` per tensor read."""
    start_load_model(chunks, directory, on_bytes)


def start_load_model(chunks: list[torch.nn.Module], directory: Path, on_bytes: OnBytes | None = None,
                     tracker: FillTracker | None = None, window: LoadWindow | None = None,
                     digests: FileDigests | None = None) -> BackgroundLoad | None:
    """Collective: `load_model`; with `tracker` (over the chunks' tensors), the reading goes on in
    the background after every collective has run, each tensor marked in `tracker` once loaded,
    and the running load is returned (`join` it; it finishes the tracker either way). Returns
    None when the load is complete on return (no tracker, or the loaded state is not the chunks'
    own tensors: then the tracker is finished too). A background load is held back by `window`
    (`load_window`), if given. The files `digests` wants are hashed as they are read, each in one
    pass (`distcp_stream`); a file whose pass did not complete (the load failed) has no digest in
    `digests.found`."""
    from megatron.core import dist_checkpointing

    from megatron_sao.checkpointing.dist_reader import CountingLoadStrategy, merge_in_place

    state = model_state(chunks)
    for chunk_state in state.values():
        merge_in_place(chunk_state, tracker)
    strategy = CountingLoadStrategy(on_bytes, tracker=tracker, window=window, digests=digests)
    loaded = dist_checkpointing.load(state, str(directory), sharded_strategy=strategy)
    background = strategy.background
    if background is not None and all(_is_own_state(chunk, loaded[key]) for key, chunk in zip(state, chunks,
                                                                                              strict=True)):
        for key, chunk in zip(state, chunks, strict=True):  # the objects: what load_state_dict would set
            chunk.load_state_dict({k: v for k, v in loaded[key].items() if not isinstance(v, torch.Tensor)},
                                  strict=False)
        return background
    if background is not None:
        background.join()
    for key, chunk in zip(state, chunks, strict=True):
        chunk.load_state_dict(loaded[key], strict=True)
    if tracker is not None:
        tracker.finish()
    return None


def _is_own_state(chunk: torch.nn.Module, loaded: dict[str, Any]) -> bool:
    """Whether `loaded` holds exactly the chunk's state tensors themselves (loaded in place), so
    `load_state_dict` would copy each onto itself, plus `_extra_state` objects."""
    own = chunk.state_dict(keep_vars=True)
    if not loaded.keys() <= own.keys() or any(not k.endswith("_extra_state") for k in own.keys() - loaded.keys()):
        return False  # (an `_extra_state` the checkpoint does not hold is what load_state_dict accepts too)
    for key, value in loaded.items():
        if not isinstance(value, torch.Tensor):
            if not key.endswith("_extra_state"):
                return False
        elif not (isinstance(own[key], torch.Tensor) and value.data_ptr() == own[key].data_ptr()
                  and value.shape == own[key].shape and value.dtype == own[key].dtype):
            return False
    return True


def tensor_table(directory: Path) -> dict[str, dict[str, Any]]:
    """{key: {dtype, shape}} of the tensors stored in a torch_dist checkpoint (global shapes)."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(str(directory))
    return {key: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.global_shape)}
            for key, t in sorted(metadata.items())}
