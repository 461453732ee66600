"""Rank function for the hand-off test: the actor's whole parameters right after construction."""

from __future__ import annotations

import torch

from tests.training.full_params import full_parameters
from tests.training.trainer_worker import build_trainer


def actor_parameters(hf_dir: str, overrides: list[str]) -> dict[str, torch.Tensor]:
    trainer = build_trainer(hf_dir, overrides)
    return full_parameters(trainer.actor.chunks)
