"""Whole (unsharded) parameters of a role, by layout-free key, on every rank: for comparing
models trained in different TP / PP / EP / DP layouts."""

from __future__ import annotations

from pathlib import Path

import torch


def full_parameters(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Collective: `{canonical key: full float64 tensor}` assembled from every rank's shards."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    from megatron_sao.checkpointing.keys import model_state, unwrap

    state = model_state([unwrap(chunk) for chunk in chunks])
    apply_factories(state)
    shards = [s for s in nested_values(state) if isinstance(s, ShardedTensor) and "_extra_state" not in s.key]
    shapes: dict[str, tuple[int, ...]] = {s.key: tuple(s.global_shape) for s in shards}
    gathered_shapes: list[dict[str, tuple[int, ...]]] = [{} for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(gathered_shapes, shapes)
    keys = sorted({k: v for d in gathered_shapes for k, v in d.items()}.items())
    full = {key: torch.zeros(shape, dtype=torch.float64) for key, shape in keys}
    for shard in shards:
        if not is_main_replica(shard.replica_id):
            continue
        assert shard.flattened_range is None
        local = shard.data.detach().to(torch.float64).reshape((1,) * shard.prepend_axis_num + tuple(shard.data.shape))
        index = tuple(slice(o, o + n) for o, n in zip(shard.global_offset, local.shape, strict=True))
        full[shard.key][index] = local
    for tensor in full.values():
        torch.distributed.all_reduce(tensor)
    return full


def checkpoint_tensors(role_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist directory (a role of a training checkpoint, or a conversion
    output), each as one global tensor, by flat key (model and optimizer state)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(tempfile.mkstemp(suffix=".pt", dir=scratch)[1])
    dcp_to_torch_save(str(role_dir), str(out))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix.rstrip(".")] = value

    walk("", torch.load(out, weights_only=False))
    out.unlink()
    return flat
