"""Rank functions of the hand-off test: the critic's values on a fixed batch, gathered whole."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.training.trajectories import random_trajectories


def _values(trainer) -> dict[str, list[float]]:
    """Every fixed trajectory's per-token values, on every rank (gathered over the world)."""
    import torch.distributed as dist

    from megatron_sao.models.outputs import values_from_head
    from megatron_sao.training.batches import shard_batch
    from megatron_sao.training.steps import forward_only
    from megatron_sao.training.trainer import role_packing

    trajectories = random_trajectories(6, seed=31, long_every=3)
    batch = shard_batch(trajectories, trainer.dp_rank, trainer.dp_size, role_packing(trainer.config, "critic"))
    heads = forward_only(trainer.critic, batch.micro_batches, lambda out, mb: values_from_head(out).detach())
    mine = {}
    for rows, values_bt, mb in zip(batch.trajectory_indices, heads, batch.micro_batches, strict=False):
        for row, index in enumerate(rows):
            mine[index] = values_bt[row, : int(mb["lengths"][row])].tolist()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {str(k): v for part in gathered for k, v in part.items()}


def values_before_and_after(hf_dir: str, overrides: list[str], iter_dir: str) -> dict[str, dict]:
    """before: the pretraining run restored from its checkpoint (critic mode); after: an RL trainer
    whose critic starts from it through `critic.load`."""
    from tests.training.trainer_worker import build_trainer

    pretrained = build_trainer(hf_dir, overrides, mode="critic")
    pretrained.load_checkpoint(Path(iter_dir))
    before = _values(pretrained)
    rl = build_trainer(hf_dir, [*overrides, f"critic.load={Path(iter_dir).parent}"], mode="rl")
    return {"before": before, "after": _values(rl), "has_actor": rl.actor is not None}


def values_after(hf_dir: str, overrides: list[str], iter_dir: str) -> dict[str, list[float]]:
    from tests.training.trainer_worker import build_trainer

    return _values(build_trainer(hf_dir, [*overrides, f"critic.load={Path(iter_dir).parent}"], mode="rl"))


def max_abs_difference(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(float((torch.tensor(a[k], dtype=torch.float64) - torch.tensor(b[k], dtype=torch.float64)).abs().max())
               for k in a)
