"""What each rank runs in the device-discipline test: a real SAO train step with the compute device
emulated apart from host memory (tests/emulated_device.py)."""

from __future__ import annotations

from typing import Any

from tests.training.trainer_worker import build_trainer
from tests.training.trajectories import random_trajectories


def step_on_emulated_device(hf_dir: str, overrides: list[str]) -> dict[str, Any]:
    """Build the actor and critic on the emulated compute device and take one step (K critic
    updates, one actor update); report what ran where."""
    from tests.emulated_device import emulated_compute_device, where

    with emulated_compute_device() as world:
        trainer = build_trainer(hf_dir, overrides)
        params = [p for role in trainer.roles.values() for chunk in role.chunks for p in chunk.parameters()]
        elsewhere = [name for role in trainer.roles.values() for chunk in role.chunks
                     for name, p in chunk.named_parameters() if where(p) is not False]
        metrics = trainer.train_step(random_trajectories(8, seed=3, long_every=8))
    return {"metrics": metrics, "collectives": world.collectives, "params": len(params),
            "params_not_on_device": elsewhere}
