"""The metric dicts of one train step, from the summed statistics of its updates.

Keys are contracts (issue "SAO trainer", section 9; other tools read them): `actor/loss`,
`actor/grad_norm`, `actor/entropy`, `actor/lr`, `actor/dis_masked_low_frac`,
`actor/dis_masked_high_frac`, `critic/value_loss`, `critic/explained_variance`,
`critic/grad_norm`, `critic/grad_norm/attention`, `critic/grad_norm/experts`, `critic/lr`,
`critic/optimizer_steps`, `moe/max_over_mean_load`, `perf/tokens_per_s`, `time/critic_s`,
`time/actor_s`, `time/data_s`, `train/skipped_steps`. More may be added; these stay.

Conventions: ratios are of sums over the global batch; with several updates per step (the
critic's K, the actor's mini-batches) losses and grad norms are those of the FIRST update (the
model as it was when the batch arrived, comparable across K) and `.../last` that of the last;
`critic/explained_variance` is that of the values the advantages were computed from, before the
critic trained on the batch, and NaN when the batch's return variance (`critic/return_var`) is at
most `critic.ev_min_return_var` (the trainer counts those steps in
`critic/explained_variance_nan_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_sao.algo import explained_variance_from_moments, return_variance_from_moments
from megatron_sao.rollout.trajectory import Trajectory, TrajectoryStatus
from megatron_sao.training.steps import RoleUpdate


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def batch_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    n = len(trajectories)
    rewards = [t.total_reward for t in trajectories]
    return {
        "train/trajectories": float(n),
        "train/tokens": float(sum(len(t) for t in trajectories)),
        "train/action_tokens": float(sum(t.num_action_tokens for t in trajectories)),
        "train/reward_mean": sum(rewards) / n,
        # Success: the episode's reward reached 1 (binary tasks, or graded ones at full marks).
        "train/success_rate": sum(r >= 1.0 for r in rewards) / n,
        "train/response_length_mean": sum(t.response_length for t in trajectories) / n,
        "train/num_turns_mean": sum(len(t.turns) for t in trajectories) / n,
        "train/truncated_frac": sum(t.status == TrajectoryStatus.TRUNCATED for t in trajectories) / n,
    }


def _norms(prefix: str, updates: Sequence[RoleUpdate]) -> dict[str, float]:
    first, last = updates[0], updates[-1]
    out = {f"{prefix}/grad_norm": first.grad_norm, f"{prefix}/grad_norm/last": last.grad_norm}
    out.update({f"{prefix}/grad_norm/{group}": norm for group, norm in first.group_norms.items()})
    return {k: float(v) for k, v in out.items() if v is not None}


def critic_metrics(phase: dict[str, float], updates: Sequence[RoleUpdate], lr: float,
                   optimizer_steps: int, min_return_var: float = 0.0) -> dict[str, float]:
    moments = torch.tensor([phase["tokens"], phase["ev_r"], phase["ev_r2"], phase["ev_res"], phase["ev_res2"]])
    tokens = phase["tokens"]
    adv_mean = _ratio(phase["adv"], tokens)
    out = {
        "critic/explained_variance": explained_variance_from_moments(moments, min_return_var),
        "critic/return_var": return_variance_from_moments(moments),
        **_bootstrap_metrics(phase),
        "critic/value_mean": _ratio(phase["value"], tokens),
        "critic/return_mean": _ratio(phase["ev_r"], tokens),
        "critic/advantage_mean": adv_mean,
        "critic/advantage_std": (math.sqrt(max(_ratio(phase["adv2"], tokens) - adv_mean**2, 0.0))
                                 if tokens else math.nan),
        "critic/lr": lr,
        "critic/optimizer_steps": float(optimizer_steps),
        "critic/updates": float(sum(u.applied for u in updates)),
    }
    first, last = updates[0].sums, updates[-1].sums
    out["critic/value_loss"] = _ratio(first["loss"], first["tokens"])
    out["critic/value_loss/last"] = _ratio(last["loss"], last["tokens"])
    out["critic/value_clip_frac"] = _ratio(first["clipped"], first["tokens"])
    out.update(_norms("critic", updates))
    return out


def _bootstrap_metrics(phase: dict[str, float]) -> dict[str, float]:
    """How much of the policy's advantage A comes from the critic's later values rather than the
    outcome: with value targets R (lambda_critic = 1: the return), `advantage_bootstrap_std` is the
    std of A - (R - V) over action tokens (0 when lambda_policy = 1) and `advantage_outcome_corr`
    the correlation of A with R - V."""
    n = phase["tokens"]
    if not n:
        return {}

    def var(total: float, squares: float) -> float:
        return max(squares / n - (total / n) ** 2, 0.0)

    var_a, var_o = var(phase["adv"], phase["adv2"]), var(phase["ev_res"], phase["ev_res2"])
    cov = phase["adv_res"] / n - (phase["adv"] / n) * (phase["ev_res"] / n)
    return {"critic/advantage_bootstrap_std": math.sqrt(var(phase["boot"], phase["boot2"])),
            "critic/advantage_outcome_corr": cov / math.sqrt(var_a * var_o) if var_a > 0 and var_o > 0 else math.nan}


def actor_metrics(updates: Sequence[RoleUpdate], lr: float, policy_loss: str) -> dict[str, float]:
    sums = {k: sum(u.sums[k] for u in updates) for k in updates[0].sums}
    tokens = sums["tokens"]
    out = {
        "actor/loss": _ratio(sums["loss"], tokens),
        "actor/entropy": _ratio(sums["entropy"], tokens),
        "actor/lr": lr,
        "actor/kl_k3": _ratio(sums["kl_k3"], tokens),
        "actor/ratio_mean": _ratio(sums["ratio"], tokens),
        "actor/action_tokens": tokens,
        # Each mini-batch's forward, before its own update (with one mini-batch: before the update).
        "rollout/logprob_abs_diff_mean": _ratio(sums["logprob_abs_diff"], tokens),
    }
    if policy_loss == "dis":
        out["actor/dis_masked_low_frac"] = _ratio(sums["masked_low"], tokens)
        out["actor/dis_masked_high_frac"] = _ratio(sums["masked_high"], tokens)
        out["actor/dis_masked_frac"] = _ratio(sums["masked_low"] + sums["masked_high"], tokens)
    else:
        out["actor/clip_frac"] = _ratio(sums["clipped"], tokens)
    out.update(_norms("actor", updates))
    return out


def sft_metrics(updates: Sequence[RoleUpdate], lr: float, policy_loss: str = "") -> dict[str, float]:
    sums = {k: sum(u.sums[k] for u in updates) for k in updates[0].sums}
    tokens = sums["tokens"]
    out = {"actor/loss": _ratio(sums["loss"], tokens), "actor/entropy": _ratio(sums["entropy"], tokens),
           "actor/lr": lr, "actor/action_tokens": tokens}
    out.update(_norms("actor", updates))
    return out
