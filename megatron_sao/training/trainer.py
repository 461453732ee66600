"""The SAO trainer: a batch of finished trajectories in, K critic updates and one actor update out.

`SaoTrainer` owns the actor and (for critic-based estimators) the critic: Megatron models in the
configured TP / PP / EP / DP layout, their optimizers and LR schedules. One `train_step`:
  1. data: the batch is split over data-parallel ranks by token count and packed into
     length-bucketed micro-batches (training/batches.py), separately per role (their token budgets
     may differ); trajectory-level advantages (GRPO, running mean) are computed on the whole batch;
  2. critic (gae / step_level): values V(s_t) of every token (forward only) -> advantages
     (length-adaptive lambda) and value targets (`lambda_critic`) -> `critic.updates_per_actor_step`
     (K) updates on the value loss over the same batch;
  3. actor, after `critic.warmup_steps` steps (from the start when there is no critic): log-probs
     of the trajectories' tokens -> DIS against the rollout log-probs (or PPO clip) -> one optimizer
     update per mini-batch (`actor.num_mini_batches`, default 1). With routing replay
     (`actor.routing_replay`, R3) the actor's forwards route every token to the experts the engine
     chose (training/routing_replay.py); rank 0 sends each rank only its part of the batch's
     routing (training/routing_shards.py). The critic routes itself.
Context parallelism (CP > 1): every rank holds whole micro-batches; the model and the losses see
this rank's two chunks of each sequence (training/context_parallel.py), and the critic's values
are gathered back to whole trajectories for GAE.
A non-finite loss or gradient skips the update on every rank and ends the step there (nothing
downstream trains on NaN advantages); the step is counted in `train/skipped_steps`, and
`run.max_consecutive_skipped_steps` in a row abort the run.

LR schedules count each role's own optimizer steps: the critic's K per train step, the actor's
`num_mini_batches` per train step after warmup.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_sao.config.schema import SaoConfig
from megatron_sao.config.validate import sequence_parallel_enabled
from megatron_sao.rollout.trajectory import Trajectory
from megatron_sao.training import advantages as adv
from megatron_sao.training.batches import (
    MicroBatch,
    PackingConfig,
    RankBatch,
    mini_batch_bounds,
    padded_tokens,
    shard_batch,
)
from megatron_sao.training.moe_load import RouterLoadTracker
from megatron_sao.training.optim import RoleOptimizer, build_optimizer, ddp_config_for
from megatron_sao.training.routing_replay import moe_layer_pattern
from megatron_sao.training.step_metrics import actor_metrics, batch_metrics, critic_metrics, sft_metrics
from megatron_sao.training.steps import (
    POLICY_SUMS,
    SFT_SUMS,
    VALUE_SUMS,
    all_ranks_agree,
    guarded_update,
    label_outputs_forward,
    policy_loss_fn,
    reduce_sums,
    sequence_outputs,
    sft_loss_fn,
    value_loss_fn,
)

logger = logging.getLogger(__name__)

Mode = Literal["rl", "sft", "critic"]
"""rl: actor + critic (or a critic-free estimator); sft: the actor alone, cross-entropy on action
tokens; critic: the critic alone, value loss against the returns (value pretraining)."""


class TrainingAborted(RuntimeError):
    """Too many consecutive steps were skipped for non-finite values."""


@dataclasses.dataclass
class TrainerState:
    """Counters that a checkpoint carries and a resume restores."""

    step: int = 0
    """Completed train steps (skipped and warmup steps included)."""
    actor_version: int = 0
    """Train steps whose actor update was applied: the policy version rollouts are tagged with."""
    actor_optimizer_steps: int = 0
    critic_optimizer_steps: int = 0
    skipped_steps: int = 0
    consecutive_skipped_steps: int = 0
    trajectories_seen: int = 0
    tokens_seen: int = 0
    ev_nan_steps: int = 0
    """Steps whose critic explained variance was not reported (returns too flat to judge by)."""


def _pad_multiple(config: SaoConfig) -> int:
    p = config.parallelism
    multiple = p.tensor if sequence_parallel_enabled(config) else 1
    return multiple * (2 * p.context if p.context > 1 else 1)


def role_packing(config: SaoConfig, role: str) -> PackingConfig:
    """How `role`'s trajectories pack into micro-batches: the one rule for every forward of that
    role (train steps, value pretraining's held-out evaluation), padded to TP under sequence
    parallel and to 2 x CP under context parallelism."""
    role_cfg = getattr(config, role)
    return PackingConfig(micro_batch_size=role_cfg.micro_batch_size,
                         max_tokens_per_micro_batch=role_cfg.max_tokens_per_micro_batch,
                         pad_to_multiple_of=_pad_multiple(config))


class SaoTrainer:
    """Actor (+ critic) on this rank; call `train_step` with the same trajectories on every rank."""

    def __init__(self, config: SaoConfig, mode: Mode = "rl") -> None:
        from megatron.core import parallel_state

        from megatron_sao.training.features import check_features_built

        check_features_built(config, mode)
        self.config = config
        self.mode = mode
        self.state = TrainerState()
        alg = config.algorithm
        self.has_critic = mode == "critic" or (mode == "rl" and adv.needs_critic(alg))
        self.warmup_steps = config.critic.warmup_steps if self.has_critic and mode == "rl" else 0
        mini = config.actor.num_mini_batches
        actor_updates = max(1, (config.run.total_steps - self.warmup_steps) * mini)
        self.actor = self._build_role("actor", actor_updates) if mode != "critic" else None
        self.critic = (self._build_role("critic", max(1, config.run.total_steps * config.critic.updates_per_actor_step))
                       if self.has_critic else None)
        self.baseline = adv.make_baseline(alg) if mode == "rl" else None
        self.router_load = RouterLoadTracker(self.actor.chunks) if self.actor is not None else None
        self.replayer, self._routing_needs = self._build_replay()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    # ---- construction ----------------------------------------------------------------------

    def _build_role(self, role: str, total_optimizer_steps: int) -> RoleOptimizer:
        from megatron_sao.models import build_model
        from megatron_sao.rollout.settings import routing_replay_enabled

        role_cfg = getattr(self.config, role)
        # RL only (SFT data has no engine routing); the critic routes itself.
        replay = role == "actor" and self.mode == "rl" and routing_replay_enabled(self.config)
        built = build_model(self.config, role, wrap_with_ddp=True, ddp_config=ddp_config_for(role_cfg.optim),
                            routing_replay=replay)
        if role_cfg.load:
            from megatron_sao.training.checkpoint import load_model_weights

            loaded = load_model_weights(Path(role_cfg.load), role, built.chunks)
            logger.info("%s weights loaded from %s", role, loaded)
        return build_optimizer(built.chunks, role_cfg.optim, total_steps=total_optimizer_steps)

    def _build_replay(self) -> tuple[Any, list[Any]]:
        """Collective: the actor's replay of engine routing, and what routing every rank needs."""
        if self.actor is None or not self.actor.chunks[0].config.moe_enable_routing_replay:
            return None, []
        from megatron_sao.training.routing_replay import RoutingReplayer
        from megatron_sao.training.routing_shards import gather_needs, local_need

        replayer = RoutingReplayer(self.actor.chunks)
        return replayer, gather_needs(local_need(replayer.layers, sequence_parallel_enabled(self.config)))

    @property
    def roles(self) -> dict[str, RoleOptimizer]:
        return {name: role for name, role in (("actor", self.actor), ("critic", self.critic)) if role is not None}

    # ---- one step --------------------------------------------------------------------------

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One train step on `trajectories` (identical on every rank); returns its metrics (the
        same on every rank, timings aside)."""
        start = time.perf_counter()
        trajectories = list(trajectories)
        trajectory_adv_b = (adv.trajectory_advantages(self.config.algorithm, trajectories, self.baseline)
                            if self.mode == "rl" and not self.has_critic else None)
        critic_batch = self._shard(trajectories, "critic") if self.has_critic else None
        actor_batches = self._actor_mini_batches(trajectories) if self.actor is not None else []
        metrics: dict[str, float] = batch_metrics(trajectories)
        computed = [mb for b, _ in actor_batches for mb in b.micro_batches] or (critic_batch.micro_batches
                                                                                  if critic_batch else [])
        metrics["perf/padding_frac"] = padded_fraction(computed)
        metrics["time/data_s"] = time.perf_counter() - start

        skipped = False
        actor_adv_rows: dict[int, torch.Tensor] = {}
        t_critic = time.perf_counter()
        if critic_batch is not None:
            skipped, actor_adv_rows = self._critic_phase(critic_batch, metrics)
        metrics["time/critic_s"] = time.perf_counter() - t_critic

        t_actor = time.perf_counter()
        actor_trains = self.actor is not None and (self.mode == "sft" or self.state.step >= self.warmup_steps)
        if not skipped and actor_trains:
            skipped = self._actor_phase(trajectories, actor_batches, actor_adv_rows, trajectory_adv_b, metrics)
        metrics["time/actor_s"] = time.perf_counter() - t_actor

        self._finish_step(trajectories, skipped, metrics)
        metrics["time/step_s"] = time.perf_counter() - start
        metrics["perf/tokens_per_s"] = metrics["train/tokens"] / max(metrics["time/step_s"], 1e-9)
        return metrics

    def _shard(self, trajectories: Sequence[Trajectory], role: str) -> RankBatch:
        return shard_batch(trajectories, self.dp_rank, self.dp_size, role_packing(self.config, role))

    def _actor_mini_batches(self, trajectories: list[Trajectory]) -> list[tuple[RankBatch, list[int]]]:
        """Per mini-batch: this rank's share and the mini-batch's indices into the global batch."""
        return [(self._shard(trajectories[lo:hi], "actor"), list(range(lo, hi)))
                for lo, hi in mini_batch_bounds(len(trajectories), self.config.actor.num_mini_batches)]

    def _replay_routing(self, trajectories: list[Trajectory], mini_batches: list[tuple[RankBatch, list[int]]]
                        ) -> dict[str, float]:
        """Collective: this rank's part of rank 0's routing onto its actor micro-batches."""
        from megatron_sao.training.routing_shards import attach, scatter_parts

        config = self.actor.chunks[0].config
        part = scatter_parts(trajectories if torch.distributed.get_rank() == 0 else None, self._routing_needs,
                             self.config.actor.num_mini_batches, self.dp_size, role_packing(self.config, "actor"),
                             num_moe_layers=sum(moe_layer_pattern(config)), topk=config.moe_router_topk)
        attach([mb for batch, _ in mini_batches for mb in batch.micro_batches], part["micro_batches"])
        return part["metrics"]

    def _critic_phase(self, batch: RankBatch, metrics: dict[str, float]) -> tuple[bool, dict[int, torch.Tensor]]:
        """Values -> advantages and targets -> K critic updates. Returns (skipped, advantage rows
        by global trajectory index, last stage only)."""
        alg, critic_cfg = self.config.algorithm, self.config.critic
        # Whole sequences on every CP rank: GAE runs over whole trajectories.
        heads = sequence_outputs(self.critic, batch.micro_batches, lambda out, mb: out.detach().float())
        rows: dict[int, torch.Tensor] = {}
        finite = True
        value_sums = []
        for k, (mb, head_bt1) in enumerate(zip(batch.micro_batches, heads, strict=False)):
            values_bt = _values(head_bt1)
            rows_b = torch.arange(head_bt1.shape[0], device=head_bt1.device)
            end_values_b = head_bt1[rows_b, (mb["lengths"] - 1).clamp_min(0), 0]
            rewards_bt = mb["rewards"]
            if alg.bootstrap_truncated:
                rewards_bt = adv.bootstrapped_rewards(rewards_bt, mb["loss_mask"], end_values_b, mb["truncated"],
                                                      alg.gamma)
            advantages_bt, returns_bt = adv.critic_advantages(alg, rewards_bt, values_bt, mb["loss_mask"])
            mb["old_values"], mb["returns"] = values_bt, returns_bt
            finite &= bool(torch.isfinite(torch.where(mb["loss_mask"], values_bt, 0.0)).all())
            lengths = mb["lengths"].tolist()  # one transfer per micro-batch, not one per row
            for row, index in enumerate(batch.trajectory_indices[k]):
                rows[index] = advantages_bt[row, : lengths[row]]
            value_sums.append({"sums": _value_phase_sums(values_bt, returns_bt, advantages_bt, mb["loss_mask"])})
        phase = reduce_sums(value_sums, VALUE_PHASE_SUMS, replicated_over_cp=True)
        if not all_ranks_agree(finite):
            return True, {}
        rows = adv.normalize_advantage_rows(rows, phase["adv"], phase["adv2"], phase["tokens"], alg.advantage_norm)
        updates = []
        lr = _lr(self.critic)
        for _ in range(critic_cfg.updates_per_actor_step):
            update = guarded_update(self.critic, batch.micro_batches, value_loss_fn(critic_cfg.value_clip), VALUE_SUMS,
                                    critic_cfg.optim.use_distributed_optimizer)
            updates.append(update)
            if not update.applied:
                break
            self.state.critic_optimizer_steps += 1
        metrics.update(critic_metrics(phase, updates, lr, self.state.critic_optimizer_steps,
                                      critic_cfg.ev_min_return_var))
        self.state.ev_nan_steps += int(math.isnan(metrics["critic/explained_variance"]))
        metrics["critic/explained_variance_nan_steps"] = float(self.state.ev_nan_steps)
        return not updates[-1].applied, rows

    def _actor_phase(self, trajectories: list[Trajectory], mini_batches: list[tuple[RankBatch, list[int]]],
                     adv_rows: dict[int, torch.Tensor], trajectory_adv_b: torch.Tensor | None,
                     metrics: dict[str, float]) -> bool:
        """One guarded update per mini-batch; returns whether the step was skipped."""
        alg, actor_cfg = self.config.algorithm, self.config.actor
        temperature = self.config.rollout.temperature
        lr = _lr(self.actor)
        if self.replayer is not None:
            metrics.update(self._replay_routing(trajectories, mini_batches))
        for batch, indices in mini_batches:
            for k, mb in enumerate(batch.micro_batches):
                global_rows = [indices[i] for i in batch.trajectory_indices[k]]
                if self.mode == "rl":
                    mb["advantages"] = _advantages_for(mb, global_rows, adv_rows, trajectory_adv_b, self.is_last_stage)
        if self.mode == "rl" and alg.policy_loss == "ppo_clip":
            self._set_old_logprobs([b for b, _ in mini_batches], temperature)
        loss_fn = policy_loss_fn(alg) if self.mode == "rl" else sft_loss_fn()
        names = POLICY_SUMS if self.mode == "rl" else SFT_SUMS
        forward = label_outputs_forward(temperature if self.mode == "rl" else 1.0, actor_cfg.logits_chunk_tokens)
        updates = []
        for batch, _ in mini_batches:
            replayed = self._replayed(_tracked_forward(self.router_load, forward), count_agreement=True)
            try:
                update = guarded_update(self.actor, batch.micro_batches, loss_fn, names,
                                        actor_cfg.optim.use_distributed_optimizer, forward_fn=replayed)
            finally:
                self._release_replay()
            updates.append(update)
            if not update.applied:
                break
            self.state.actor_optimizer_steps += 1
        load = self.router_load.collect()
        if self.replayer is not None:
            load.update(self.replayer.collect_agreement())
        if not updates[-1].applied:
            return True
        summary = actor_metrics if self.mode == "rl" else sft_metrics
        metrics.update(summary(updates, lr, alg.policy_loss))
        metrics.update(load)
        return False

    def _set_old_logprobs(self, batches: list[RankBatch], temperature: float) -> None:
        from megatron_sao.training.context_parallel import token_positions

        if self.config.algorithm.old_logprobs == "rollout":
            for batch in batches:
                for mb in batch.micro_batches:
                    mb["old_logprobs"] = mb["rollout_logprobs"]
            return
        forward = label_outputs_forward(temperature, self.config.actor.logits_chunk_tokens)
        for batch in batches:
            try:
                logprobs = sequence_outputs(self.actor, batch.micro_batches, lambda out, mb: out[0],
                                            self._replayed(forward))
            finally:
                self._release_replay()
            for mb, logprobs_bs in zip(batch.micro_batches, logprobs, strict=False):
                mb["old_logprobs"] = token_positions(logprobs_bs)

    def _replayed(self, forward_fn: Any, count_agreement: bool = False) -> Any:
        """`forward_fn` replaying each micro-batch's engine routing (as is without replay)."""
        return forward_fn if self.replayer is None else self.replayer.wrap(forward_fn, count_agreement)

    def _release_replay(self) -> None:
        if self.replayer is not None:
            self.replayer.release()

    def _finish_step(self, trajectories: list[Trajectory], skipped: bool, metrics: dict[str, float]) -> None:
        state = self.state
        actor_trained = "actor/loss" in metrics
        state.step += 1
        state.trajectories_seen += len(trajectories)
        state.tokens_seen += int(metrics["train/tokens"])
        if actor_trained and not skipped:
            state.actor_version += 1
        state.skipped_steps += int(skipped)
        state.consecutive_skipped_steps = state.consecutive_skipped_steps + 1 if skipped else 0
        metrics.update({"train/skipped_steps": float(state.skipped_steps), "train/step_skipped": float(skipped),
                        "train/actor_version": float(state.actor_version)})
        if skipped:
            logger.warning("step %d skipped: non-finite loss or gradient (%d in a row)", state.step,
                           state.consecutive_skipped_steps)
        limit = self.config.run.max_consecutive_skipped_steps
        if state.consecutive_skipped_steps >= limit:
            raise TrainingAborted(f"{state.consecutive_skipped_steps} consecutive steps skipped for non-finite "
                                  f"loss or gradients (run.max_consecutive_skipped_steps={limit}); stopping at step "
                                  f"{state.step}")

    # ---- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable trainer state (the models and optimizers are checkpointed apart)."""
        return {"trainer": dataclasses.asdict(self.state),
                "baseline": self.baseline.state_dict() if self.baseline is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = TrainerState(**state["trainer"])
        if self.baseline is not None:
            if state.get("baseline") is None:
                raise ValueError("the checkpoint has no running-mean baseline state "
                                 "(algorithm.advantage=running_mean needs one)")
            self.baseline.load_state_dict(state["baseline"])

    def save_checkpoint(self, checkpoints_dir: Path, extra: dict[str, Any] | None = None,
                        final: bool = False) -> Path:
        """Collective. On GPU with `checkpoint.async_save` the shards are written in the background
        (`finalize_async_saves` completes them); a `final` save is always synchronous."""
        from megatron_sao.training.checkpoint import save_checkpoint

        async_save = self.config.checkpoint.async_save and torch.cuda.is_available() and not final
        return save_checkpoint(checkpoints_dir, self.state.step, self.roles, {**self.state_dict(), **(extra or {})},
                               keep_last=self.config.checkpoint.keep_last, async_save=async_save)

    def load_checkpoint(self, iter_dir: Path) -> dict[str, Any]:
        """Restore models, optimizers, schedules, RNG and counters; returns the whole saved state
        (the caller's `extra` included)."""
        from megatron_sao.training.checkpoint import load_checkpoint

        state = load_checkpoint(iter_dir, self.roles)
        self.load_state_dict(state)
        return state


# ---- helpers -------------------------------------------------------------------------------------

VALUE_PHASE_SUMS = ("tokens", "ev_r", "ev_r2", "ev_res", "ev_res2", "value", "adv", "adv2", "boot", "boot2",
                    "adv_res")


def _values(head_bt1: torch.Tensor) -> torch.Tensor:
    from megatron_sao.models.outputs import values_from_head

    return values_from_head(head_bt1)


def _value_phase_sums(values_bt: torch.Tensor, returns_bt: torch.Tensor, advantages_bt: torch.Tensor,
                      mask_bt: torch.Tensor) -> torch.Tensor:
    from megatron_sao.algo import explained_variance_moments

    moments = explained_variance_moments(values_bt, returns_bt, mask_bt)
    a = torch.where(mask_bt, advantages_bt.double(), 0.0)
    v = torch.where(mask_bt, values_bt.double(), 0.0)
    outcome = torch.where(mask_bt, returns_bt.double(), 0.0) - v  # R - V: the advantage without bootstrapping
    boot = a - outcome  # what the critic's later values add to (or take from) it
    return torch.cat([moments[:1], moments[1:], torch.stack([v.sum(), a.sum(), a.square().sum(), boot.sum(),
                                                             boot.square().sum(), (a * outcome).sum()])])


def _advantages_for(mb: MicroBatch, global_rows: list[int], adv_rows: dict[int, torch.Tensor],
                    trajectory_adv_b: torch.Tensor | None, is_last_stage: bool) -> torch.Tensor:
    """`[b, t]` advantages of an actor micro-batch from the critic's rows or trajectory scalars."""
    mask_bt = mb["loss_mask"]
    if trajectory_adv_b is not None:  # computed on the host from the trajectories' rewards
        per_row = trajectory_adv_b[global_rows] if global_rows else torch.zeros(mask_bt.shape[0])
        return torch.where(mask_bt, per_row.to(mask_bt.device)[:, None].expand_as(mask_bt), 0.0)
    out_bt = torch.zeros(mask_bt.shape, dtype=torch.float32, device=mask_bt.device)
    if is_last_stage:  # the critic's values (hence advantages) exist on the last stage only
        for row, index in enumerate(global_rows):
            values = adv_rows[index]
            out_bt[row, : values.shape[0]] = values
    return out_bt


def _tracked_forward(tracker: RouterLoadTracker, forward_fn):
    def forward(model: torch.nn.Module, mb: MicroBatch):
        with tracker.tracking(mb["token_mask"]):
            return forward_fn(model, mb)

    return forward


def _lr(role: RoleOptimizer) -> float:
    return float(role.optimizer.param_groups[0]["lr"])


def padded_fraction(micro_batches: Sequence[MicroBatch]) -> float:
    """Share of this rank's computed tokens that are padding."""
    real = sum(int(mb["lengths"].sum()) for mb in micro_batches)
    total = padded_tokens(micro_batches)
    return 1.0 - real / total if total else math.nan

