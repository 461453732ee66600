"""Hypothesis strategies and small fixtures for trajectory tests."""

from __future__ import annotations

from hypothesis import strategies as st

from megatron_sao.rollout.trajectory import FinishType, RewardKind, Trajectory, TrajectoryStatus


@st.composite
def trajectories(draw) -> tuple[Trajectory, dict]:
    """A random multi-turn trajectory plus the per-token truth it was built from."""
    prompt = draw(st.lists(st.integers(0, 319), min_size=1, max_size=12))
    num_turns = draw(st.integers(1, 5))
    traj = Trajectory(prompt_id=draw(st.text(min_size=1, max_size=8)))
    traj.set_prompt(prompt)
    mask, versions, logprobs = [0] * len(prompt), [-1] * len(prompt), [0.0] * len(prompt)
    version = draw(st.integers(0, 3))
    for turn in range(num_turns):
        # an action may come in several engine calls (resumed after an abort)
        for _ in range(draw(st.integers(1, 3))):
            n = draw(st.integers(1, 6))
            ids = draw(st.lists(st.integers(0, 319), min_size=n, max_size=n))
            lps = draw(st.lists(st.floats(-30.0, 0.0), min_size=n, max_size=n))
            vs = []
            for _ in range(n):  # weight updates may land anywhere, versions only go up
                version += draw(st.integers(0, 1))
                vs.append(version)
            traj.append_action(ids, lps, vs, FinishType.STOP)
            mask += [1] * n
            versions += vs
            logprobs += lps
        if draw(st.booleans()):
            traj.add_reward(draw(st.floats(-1.0, 1.0)), RewardKind.TURN)
        if turn < num_turns - 1:
            obs = draw(st.lists(st.integers(0, 319), min_size=1, max_size=8))
            traj.append_observation(obs)
            mask += [0] * len(obs)
            versions += [-1] * len(obs)
            logprobs += [0.0] * len(obs)
    traj.add_reward(draw(st.floats(-1.0, 1.0)), RewardKind.TERMINAL)
    traj.finish(TrajectoryStatus.COMPLETED, "done")
    return traj, {"mask": mask, "versions": versions, "logprobs": logprobs, "num_turns": num_turns}


def two_turn() -> Trajectory:
    traj = Trajectory(prompt_id="p")
    traj.set_prompt([1, 2, 3])
    traj.append_action([4, 5], [-0.5, -0.25], [0, 0], FinishType.STOP)
    traj.append_observation([6])
    traj.append_action([7], [-1.0], [1], FinishType.STOP)
    traj.add_reward(1.0, RewardKind.TERMINAL)
    traj.finish(TrajectoryStatus.COMPLETED)
    return traj
