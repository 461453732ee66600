"""Held-out evaluation of the critic: explained variance, value MSE and a calibration table.

The target is the Monte-Carlo return (reward-to-go over action tokens, discount
`algorithm.gamma`), whatever the training target (`lambda_critic` < 1 trains on TD(lambda)
returns, which depend on the critic itself; the held-out figures measure it against what actually
happened). Every action token of the held-out trajectories counts once.

Calibration: action tokens are binned by predicted value over `bins` equal-width bins spanning
the held-out returns' range (predictions outside it fall in the first / last bin); per bin the
table has the token count, the mean prediction and the mean empirical return. A calibrated
critic has the two means equal in every bin; `calibration_error` is their count-weighted mean
absolute gap.

Explained variance is undefined (NaN) when the held-out returns do not vary; it is then reported
as `null` / "undefined", never as a number a threshold could pass.

Collective: every rank calls `evaluate_heldout` with the same trajectories; the work is split over
data-parallel ranks and the sums are reduced, so every rank gets the same result.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from megatron_sao.rollout.trajectory import Trajectory


def mc_returns(traj: Trajectory, gamma: float) -> list[float]:
    """Reward-to-go at each action token (observation tokens are skipped, as in the GAE)."""
    rewards: dict[int, float] = {}
    for reward in traj.rewards:
        rewards[reward.position] = rewards.get(reward.position, 0.0) + reward.value
    out, running = [], 0.0
    for t in range(len(traj.token_ids) - 1, -1, -1):
        if traj.loss_mask[t]:
            running = rewards.get(t, 0.0) + gamma * running
            out.append(running)
    return out[::-1]


def return_range(trajectories: Sequence[Trajectory], gamma: float) -> tuple[float, float]:
    values = [g for traj in trajectories for g in mc_returns(traj, gamma)]
    if not values:
        raise ValueError("the held-out split has no action token to evaluate on")
    lo, hi = min(values), max(values)
    return (lo - 0.5, hi + 0.5) if hi - lo < 1e-9 else (lo, hi)


@dataclasses.dataclass
class CalibrationBin:
    lo: float
    hi: float
    count: int
    mean_value: float | None
    mean_return: float | None


@dataclasses.dataclass
class HeldoutResult:
    step: int
    num_trajectories: int
    num_tokens: int
    explained_variance: float
    """NaN when the returns do not vary (undefined)."""
    value_mse: float
    bins: list[CalibrationBin]

    @property
    def ev_defined(self) -> bool:
        return math.isfinite(self.explained_variance)

    @property
    def calibration_error(self) -> float:
        filled = [b for b in self.bins if b.count]
        total = sum(b.count for b in filled)
        return sum(b.count * abs(b.mean_value - b.mean_return) for b in filled) / total if total else math.nan

    def metrics(self) -> dict[str, float]:
        """For metrics.jsonl / wandb; explained variance only when defined (plus a 0/1 flag)."""
        out = {"eval/value_mse": self.value_mse, "eval/calibration_error": self.calibration_error,
               "eval/tokens": float(self.num_tokens), "eval/explained_variance_defined": float(self.ev_defined)}
        if self.ev_defined:
            out["eval/explained_variance"] = self.explained_variance
        return out

    def ev_text(self) -> str:
        return f"{self.explained_variance:.4f}" if self.ev_defined else "undefined (held-out returns do not vary)"

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "trajectories": self.num_trajectories, "action_tokens": self.num_tokens,
                "explained_variance": self.explained_variance if self.ev_defined else None,
                "explained_variance_note": None if self.ev_defined else "undefined: held-out returns do not vary",
                "value_mse": self.value_mse, "calibration_error": self.calibration_error,
                "bins": [dataclasses.asdict(b) for b in self.bins]}

    def table(self) -> str:
        def fmt(v: float | None) -> str:
            return f"{v:9.4f}" if v is not None else f"{'-':>9}"

        lines = [f"{'bin':>17} {'tokens':>8} {'mean V':>9} {'mean G':>9}"]
        for b in self.bins:
            lines.append(f"[{b.lo:7.3f},{b.hi:7.3f}) {b.count:8d} {fmt(b.mean_value)} {fmt(b.mean_return)}")
        return "\n".join(lines)


def evaluate_heldout(critic: Any, trajectories: Sequence[Trajectory], packing: Any, dp_rank: int, dp_size: int,
                     gamma: float, value_range: tuple[float, float], num_bins: int, step: int) -> HeldoutResult:
    """Collective (see the module docstring). `critic` is the trainer's critic `RoleOptimizer`."""
    from megatron_sao.algo import explained_variance_from_moments, explained_variance_moments, skip_observation_gae
    from megatron_sao.models.outputs import values_from_head
    from megatron_sao.training.batches import shard_batch
    from megatron_sao.training.steps import reduce_sums, sequence_outputs

    if num_bins < 1:
        raise ValueError(f"value_pretrain.calibration_bins must be >= 1, got {num_bins}")
    lo, hi = value_range

    def sums_of(head: torch.Tensor, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        values_bt = values_from_head(head).float()
        mask_bt = mb["loss_mask"]
        _, returns_bt = skip_observation_gae(mb["rewards"], values_bt, mask_bt, gamma=gamma, lam=1.0)
        moments = explained_variance_moments(values_bt, returns_bt, mask_bt)
        v, g = values_bt[mask_bt].double(), returns_bt[mask_bt].double()
        inner_edges = torch.linspace(lo, hi, num_bins + 1, dtype=torch.float64, device=v.device)[1:-1]
        index = torch.bucketize(v, inner_edges, right=True)
        counts = v.new_zeros(num_bins).index_add_(0, index, torch.ones_like(v))
        sum_v = v.new_zeros(num_bins).index_add_(0, index, v)
        sum_g = v.new_zeros(num_bins).index_add_(0, index, g)
        return {"sums": torch.cat([moments, (v - g).square().sum().reshape(1), counts, sum_v, sum_g])}

    batch = shard_batch(trajectories, dp_rank, dp_size, packing)
    # Whole sequences (gathered over context parallelism): the returns need whole trajectories.
    heads = sequence_outputs(critic, batch.micro_batches, lambda out, mb: out.detach().float())
    outputs = [sums_of(head, mb) for head, mb in zip(heads, batch.micro_batches, strict=False)]
    names = (["n", "r", "r2", "res", "res2", "sq"] + [f"count{i}" for i in range(num_bins)]
             + [f"v{i}" for i in range(num_bins)] + [f"g{i}" for i in range(num_bins)])
    sums = reduce_sums(outputs, names, replicated_over_cp=True)
    moments = torch.tensor([sums[k] for k in ("n", "r", "r2", "res", "res2")], dtype=torch.float64)
    edges = torch.linspace(lo, hi, num_bins + 1, dtype=torch.float64).tolist()
    bins = []
    for i in range(num_bins):
        count = round(sums[f"count{i}"])
        bins.append(CalibrationBin(edges[i], edges[i + 1], count, sums[f"v{i}"] / count if count else None,
                                   sums[f"g{i}"] / count if count else None))
    n = round(sums["n"])
    return HeldoutResult(step=step, num_trajectories=len(trajectories), num_tokens=n,
                         explained_variance=explained_variance_from_moments(moments),
                         value_mse=sums["sq"] / n if n else math.nan, bins=bins)
