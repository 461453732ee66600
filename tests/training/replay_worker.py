"""What each rank runs in the routing-replay (R3) tests: SAO steps with the engine's routing
replayed, reporting metrics, parameters and the experts the actor's routers actually used."""

from __future__ import annotations

from typing import Any

import torch

from megatron_sao.rollout.trajectory import Trajectory
from tests.training.full_params import full_parameters
from tests.training.trainer_worker import build_trainer
from tests.training.trajectories import random_trajectories, with_random_routing


def replay_step(hf_dir: str, overrides: list[str], routing_seed: int | None) -> dict[str, Any]:
    """One SAO step (actor.routing_replay=true) on 8 mixed-length trajectories carrying random
    routing (`routing_seed`; None: no routing), as in `trainer_worker.one_step_in_layout`."""
    trainer = build_trainer(hf_dir, ["actor.routing_replay=true", *overrides])
    trajectories = random_trajectories(8, seed=3, long_every=8)
    if routing_seed is not None:
        trajectories = with_random_routing(trajectories, seed=routing_seed, unrouted_every=5)
    metrics = trainer.train_step(trajectories)
    return {"metrics": metrics, "actor": full_parameters(trainer.actor.chunks),
            "critic": full_parameters(trainer.critic.chunks)}


def recomputed_replay_step(hf_dir: str, overrides: list[str], routing_seed: int) -> dict[str, Any]:
    """`replay_step` with full activation recomputation: the backward re-runs every layer's forward
    (routers included), which must replay the routing of the micro-batch it recomputes (Megatron's
    REPLAY_BACKWARD FIFO). Megatron's checkpoint saves and restores the CUDA RNG state; without a
    GPU that state is stubbed here (dropout is off, nothing draws from it)."""
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.zeros(1, dtype=torch.uint8)
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    return replay_step(hf_dir, ["model.recompute_granularity=full", *overrides], routing_seed)


def recorded_losses(hf_dir: str, files: dict[str, str]) -> dict[str, dict[str, float]]:
    """One step per (replay on / off) x recorded file, each from the same initial weights."""
    from megatron_sao.rollout.recorded import RecordedTrajectories

    out = {}
    for replay in ("true", "false"):
        for name, path in files.items():
            trainer = build_trainer(hf_dir, [f"actor.routing_replay={replay}"])
            batch = RecordedTrajectories(path, batch_size=6).next_batch()
            out[f"{name}/replay={replay}"] = trainer.train_step(batch)
    return out


def _experts_used(trainer: Any, trajectories: list[Trajectory]) -> tuple[dict[str, float], float]:
    """Step with replay on; return its metrics and the share of routed (token, layer) pairs the
    actor's update forward sent to exactly the engine's experts (1 process: no pipeline stage, no
    sequence split, so each router sees `[s, b]` tokens of its micro-batch)."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: maps.append(out[1].detach().clone()))
             for c in trainer.actor.chunks for m in c.modules() if isinstance(m, TopKRouter)]
    built: list[Any] = []
    shard = trainer._actor_mini_batches
    trainer._actor_mini_batches = lambda trajs: built.extend(shard(trajs)) or built
    metrics = trainer.train_step(trajectories)
    for hook in hooks:
        hook.remove()
    micro_batches = [mb for batch, _ in built for mb in batch.micro_batches]
    num_layers = len(maps) // len(micro_batches)  # the update forward only (DIS: no other actor pass)
    same = total = 0
    for k, mb in enumerate(micro_batches):
        engine_bslk = mb["routed_experts"]
        b, s = engine_bslk.shape[:2]
        for layer in range(num_layers):
            used_bse = maps[k * num_layers + layer].view(s, b, -1).transpose(0, 1)
            engine_bsk = engine_bslk[:, :, layer, :].long()
            routed_bs = (engine_bsk >= 0).all(dim=-1)
            wanted_bse = torch.zeros_like(used_bse).scatter_(2, engine_bsk.clamp_min(0), True)
            same += int((used_bse == wanted_bse).all(dim=-1)[routed_bs].sum())
            total += int(routed_bs.sum())
    return metrics, same / total


def engine_replay(hf_dir: str, trajectories: list[Trajectory]) -> dict[str, Any]:
    """The same engine trajectories trained with replay on and off (fresh trainers, same weights)."""
    on = build_trainer(hf_dir, ["actor.routing_replay=true"])
    metrics_on, used_engines = _experts_used(on, trajectories)
    off = build_trainer(hf_dir, ["actor.routing_replay=false"])
    metrics_off = off.train_step(trajectories)
    stripped = [Trajectory(**{**{f: getattr(t, f) for f in t.__dataclass_fields__}, "routed_experts": None})
                for t in trajectories]
    metrics_plain = build_trainer(hf_dir, ["actor.routing_replay=false"]).train_step(stripped)
    return {"on": metrics_on, "off": metrics_off, "plain": metrics_plain, "engine_experts_used": used_engines}
