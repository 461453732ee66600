"""Random but valid trajectories of mixed lengths for trainer tests (no model needed).

Rollout log-probs are drawn near log(1/vocab) so that DIS ratios against an untrained tiny model
stay mostly inside the band; rewards are 0/1 terminal ones, some turns carry a small reward.
"""

from __future__ import annotations

import math
import random

from megatron_sao.rollout.trajectory import FinishType, RewardKind, Trajectory, TrajectoryStatus


def random_trajectories(num: int, seed: int = 0, vocab: int = 256, lengths: tuple[int, int] = (12, 40),
                        long_every: int = 0, long_factor: int = 4, group_size: int = 1,
                        constant_reward: float | None = None) -> list[Trajectory]:
    """`num` trajectories (`group_size` consecutive ones share a prompt id); every `long_every`-th
    is about `long_factor` times longer (a long tail). `constant_reward`: every trajectory gets
    exactly this terminal reward and no turn reward (every return equal)."""
    rng = random.Random(seed)
    base_logp = -math.log(vocab)
    out = []
    for i in range(num):
        target = rng.randint(*lengths)
        if long_every and i % long_every == long_every - 1:
            target *= long_factor
        traj = Trajectory(prompt_id=f"p{i // group_size}", trajectory_id=f"t{i}")
        prompt_len = rng.randint(3, 8)
        traj.set_prompt([rng.randrange(vocab) for _ in range(prompt_len)])
        num_turns = rng.randint(1, 3)
        budget = max(target - prompt_len, 2 * num_turns)
        for turn in range(num_turns):
            n_act = max(1, budget // (2 * num_turns))
            traj.append_action([rng.randrange(vocab) for _ in range(n_act)],
                               [base_logp + rng.uniform(-0.3, 0.3) for _ in range(n_act)], [0] * n_act,
                               FinishType.STOP)
            if rng.random() < 0.3 and constant_reward is None:
                traj.add_reward(0.1, RewardKind.TURN)
            if turn < num_turns - 1:
                traj.append_observation([rng.randrange(vocab) for _ in range(max(1, budget // (2 * num_turns)))])
        success = float(rng.random() < 0.5)
        traj.add_reward(success if constant_reward is None else constant_reward, RewardKind.TERMINAL)
        traj.finish(TrajectoryStatus.TRUNCATED if rng.random() < 0.2 else TrajectoryStatus.COMPLETED)
        traj.validate()
        out.append(traj)
    return out


def with_random_routing(trajectories: list[Trajectory], seed: int = 0, num_layers: int = 2, topk: int = 2,
                        num_experts: int = 4, unrouted_every: int = 0) -> list[Trajectory]:
    """Copies of `trajectories` carrying random (valid) `routed_experts`: distinct experts per token
    and layer; the last token is never routed (as from an engine) and, with `unrouted_every`,
    neither is every `unrouted_every`-th token nor the `unrouted_every`-th trajectory."""
    import copy

    import numpy as np

    from megatron_sao.rollout.routing import NOT_ROUTED, RoutedExperts

    rng = np.random.default_rng(seed)
    out = []
    for i, traj in enumerate(trajectories):
        traj = copy.deepcopy(traj)
        n = len(traj)
        scores = rng.random((n, num_layers, num_experts))
        indices = np.argsort(scores, axis=2)[:, :, :topk]
        indices[-1] = NOT_ROUTED
        if unrouted_every:
            indices[::unrouted_every] = NOT_ROUTED
        traj.routed_experts = None if unrouted_every and i % unrouted_every == unrouted_every - 1 else \
            RoutedExperts(indices)
        traj.validate()
        out.append(traj)
    return out
