"""The trajectory record: what the agent loop produces and the trainer consumes.

One trajectory is `[prompt][a_0][o_0][a_1][o_1]...[a_N]` (SAO_METHOD.md, "Data: one trajectory"):
`a_i` are action spans sampled by the rollout engine, `o_i` observation spans written by the
environment and rendered by the chat template. Everything is kept per token, in the engine's own
token ids (token-in / token-out: generated text is never re-tokenised, so `rollout_logprobs[t]`
is exactly the log-prob the engine assigned to `token_ids[t]`).

Per-token arrays (all of length `len(token_ids)`):

- `loss_mask`: 1 on action tokens, 0 on prompt and observation tokens;
- `rollout_logprobs`: the engine's log-prob of the sampled token on action tokens, 0.0 elsewhere;
- `policy_versions`: the engine weight version that sampled the token on action tokens, -1
  elsewhere (a trajectory spans several versions when weights change mid-generation);
- `routed_experts` (optional, MoE engines asked for it): per token, per MoE layer, the top-k
  experts the engine's router chose when it computed that token (`rollout/routing.py`); None
  when the engine did not report routing.

Rewards are sparse: each `Reward` is credited to one action token (a per-turn reward to the last
token of its action span, the terminal reward to the last action token of the trajectory);
several rewards on one token add up.

The last span of a trajectory is always an action: the agent loop never appends an observation
that no action follows (see docs/rollout.md). Serialisation lives in `trajectory_io.py`, padded
trainer tensors in `trajectory_batch.py`.
"""

from __future__ import annotations

import enum
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_sao.rollout.routing import RoutedExperts

NO_POLICY_VERSION = -1
"""`policy_versions` value of prompt and observation tokens (they were not sampled)."""


class TrajectoryStatus(enum.StrEnum):
    """How a trajectory ended. `RUNNING` only while the agent loop is still building it."""

    RUNNING = "running"
    COMPLETED = "completed"  # the environment said done
    TRUNCATED = "truncated"  # a turn or token limit was hit first
    ABORTED = "aborted"  # the rollout was aborted (shutdown, explicit abort)
    FAILED = "failed"  # the environment or the reward raised; `status_reason` says why


class RewardKind(enum.StrEnum):
    TURN = "turn"  # optional per-turn reward, on the last token of its action span
    TERMINAL = "terminal"  # the episode's reward, on the last action token


class FinishType(enum.StrEnum):
    """Why the engine stopped one action span (SGLang's `finish_reason.type`)."""

    STOP = "stop"  # a stop token / string was sampled
    LENGTH = "length"  # max_new_tokens (the turn or the trajectory token budget)
    ABORT = "abort"  # the engine aborted the request


@dataclass(slots=True)
class Turn:
    """Token boundaries of one turn: action `[action_start, action_end)`, then its observation
    `[action_end, observation_end)` (empty for the last turn)."""

    action_start: int
    action_end: int
    observation_end: int
    finish_type: FinishType = FinishType.STOP

    @property
    def num_action_tokens(self) -> int:
        return self.action_end - self.action_start

    @property
    def num_observation_tokens(self) -> int:
        return self.observation_end - self.action_end


@dataclass(slots=True)
class Reward:
    """One scalar reward credited to token `position` (an action token) of turn `turn`."""

    value: float
    position: int
    kind: RewardKind
    turn: int


@dataclass(slots=True)
class Timings:
    """Wall-clock bookkeeping. `started_at` / `finished_at` are Unix times; the `*_s` fields are
    summed durations (generation and environment time overlap with other trajectories')."""

    started_at: float = 0.0
    finished_at: float = 0.0
    generate_s: float = 0.0
    env_s: float = 0.0

    @property
    def total_s(self) -> float:
        return max(0.0, self.finished_at - self.started_at)


@dataclass(slots=True)
class Trajectory:
    """One episode, token by token. Build it with the `append_*` / `add_reward` / `finish` methods
    (they keep the invariants); `validate()` checks a record loaded from elsewhere."""

    prompt_id: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    prompt_length: int = 0
    turns: list[Turn] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)
    status: TrajectoryStatus = TrajectoryStatus.RUNNING
    status_reason: str = ""
    timings: Timings = field(default_factory=Timings)
    num_engine_calls: int = 0
    num_engine_retries: int = 0
    """Generate calls re-sent after an engine failure or an engine-side abort."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable extras (dataset metadata, environment info)."""
    trajectory_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    routed_experts: RoutedExperts | None = None
    """Per token, per MoE layer, the engine's top-k expert indices (`[n, L, k]`, `NOT_ROUTED` rows
    for tokens the engine did not route); None without routing. Replayed by the actor (R3)."""

    # ---- building ---------------------------------------------------------------------------

    def set_prompt(self, token_ids: Sequence[int]) -> None:
        if self.token_ids:
            raise ValueError("set_prompt must be called once, on an empty trajectory")
        self._extend(token_ids, mask=0, logprobs=None, versions=None)
        self.prompt_length = len(token_ids)

    def append_action(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        finish_type: FinishType,
    ) -> None:
        """Append sampled tokens. Continues the current action span if the last span is an action
        (an engine call resumed after an abort), else opens a new turn."""
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise ValueError(
                f"action arrays differ in length: {len(token_ids)} tokens, {len(logprobs)} logprobs, "
                f"{len(versions)} versions"
            )
        if any(v < 0 for v in versions):
            raise ValueError(f"policy versions of sampled tokens must be >= 0, got {list(versions)}")
        if self.prompt_length == 0 and not self.token_ids:
            raise ValueError("append_action before set_prompt")
        start = len(self.token_ids)
        self._extend(token_ids, mask=1, logprobs=logprobs, versions=versions)
        end = len(self.token_ids)
        last = self.turns[-1] if self.turns else None
        if last is not None and last.observation_end == last.action_end == start:
            last.action_end = last.observation_end = end
            last.finish_type = finish_type
        else:
            self.turns.append(Turn(start, end, end, finish_type))

    def append_observation(self, token_ids: Sequence[int]) -> None:
        """Append environment tokens (chat-template glue included) after the last action."""
        if not self.turns or self.turns[-1].observation_end != self.turns[-1].action_end:
            raise ValueError("an observation must follow an action span")
        self._extend(token_ids, mask=0, logprobs=None, versions=None)
        self.turns[-1].observation_end = len(self.token_ids)

    def add_reward(self, value: float, kind: RewardKind, turn: int | None = None) -> Reward:
        """Credit `value` to the last action token of `turn` (default: the last turn)."""
        if not self.turns:
            raise ValueError("a reward needs at least one action token to be credited to")
        index = len(self.turns) - 1 if turn is None else turn
        if not 0 <= index < len(self.turns):
            raise ValueError(f"turn {index} out of range ({len(self.turns)} turns)")
        reward = Reward(float(value), self.turns[index].action_end - 1, RewardKind(kind), index)
        self.rewards.append(reward)
        return reward

    def record_routing(self, start: int, rows_mlk: np.ndarray) -> None:
        """The engine's routing of tokens `[start, start + m)` (`rows_mlk`: `[m, L, k]` expert
        indices); tokens already routed keep theirs (the forward that first computed a token is the
        one whose routing produced the next token's log-prob)."""
        if self.routed_experts is None:
            self.routed_experts = RoutedExperts.empty(0, rows_mlk.shape[1], rows_mlk.shape[2])
        known = self.routed_experts.num_leading_routed()
        if start + len(rows_mlk) > len(self.token_ids):
            raise ValueError(f"routing of tokens [{start}, {start + len(rows_mlk)}) beyond the trajectory's "
                             f"{len(self.token_ids)} tokens")
        if start + len(rows_mlk) > known:
            skip = max(0, known - start)
            self.routed_experts = self.routed_experts.with_rows(start + skip, rows_mlk[skip:])

    def finish(self, status: TrajectoryStatus, reason: str = "") -> None:
        if status == TrajectoryStatus.RUNNING:
            raise ValueError("finish() needs a final status")
        self.status = TrajectoryStatus(status)
        self.status_reason = reason
        if self.routed_experts is not None:  # the last token(s) were never fed to the engine
            self.routed_experts = self.routed_experts.resized(len(self.token_ids))

    def _extend(
        self,
        token_ids: Sequence[int],
        mask: int,
        logprobs: Sequence[float] | None,
        versions: Sequence[int] | None,
    ) -> None:
        n = len(token_ids)
        self.token_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([mask] * n)
        self.rollout_logprobs.extend([0.0] * n if logprobs is None else (float(x) for x in logprobs))
        self.policy_versions.extend([NO_POLICY_VERSION] * n if versions is None else (int(v) for v in versions))

    # ---- reading ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def response_length(self) -> int:
        """Tokens after the prompt (actions and observations)."""
        return len(self.token_ids) - self.prompt_length

    @property
    def terminal_reward(self) -> float | None:
        for reward in self.rewards:
            if reward.kind == RewardKind.TERMINAL:
                return reward.value
        return None

    @property
    def total_reward(self) -> float:
        return sum(r.value for r in self.rewards)

    def action_versions(self) -> list[int]:
        return [v for v, m in zip(self.policy_versions, self.loss_mask, strict=True) if m]

    def staleness(self, actor_version: int) -> list[int]:
        """`actor_version - policy_version` for every action token, in order."""
        return [actor_version - v for v in self.action_versions()]

    def validate(self) -> None:
        """Check every invariant; raises ValueError naming the first one broken."""
        n = len(self.token_ids)
        where = f"trajectory {self.trajectory_id} (prompt {self.prompt_id!r})"
        for name in ("loss_mask", "rollout_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{where}: {name} has {len(getattr(self, name))} entries for {n} tokens")
        if not 0 <= self.prompt_length <= n:
            raise ValueError(f"{where}: prompt_length {self.prompt_length} outside [0, {n}]")
        expected_mask = [0] * n
        cursor = self.prompt_length
        for i, turn in enumerate(self.turns):
            if turn.action_start != cursor:
                raise ValueError(f"{where}: turn {i} starts at {turn.action_start}, expected {cursor}")
            if not turn.action_start < turn.action_end <= turn.observation_end:
                raise ValueError(f"{where}: turn {i} has bad boundaries {turn}")
            expected_mask[turn.action_start : turn.action_end] = [1] * turn.num_action_tokens
            cursor = turn.observation_end
        if cursor != n:
            raise ValueError(f"{where}: turns cover tokens up to {cursor}, trajectory has {n}")
        if self.loss_mask != expected_mask:
            bad = next(t for t in range(n) if self.loss_mask[t] != expected_mask[t])
            raise ValueError(f"{where}: loss_mask[{bad}] = {self.loss_mask[bad]} disagrees with the turns")
        for t in range(n):
            if self.loss_mask[t]:
                if self.policy_versions[t] < 0:
                    raise ValueError(f"{where}: action token {t} has policy version {self.policy_versions[t]}")
                if not math.isfinite(self.rollout_logprobs[t]) or self.rollout_logprobs[t] > 0.0:
                    raise ValueError(f"{where}: action token {t} has log-prob {self.rollout_logprobs[t]}")
            elif self.policy_versions[t] != NO_POLICY_VERSION or self.rollout_logprobs[t] != 0.0:
                raise ValueError(f"{where}: non-action token {t} carries a version or a log-prob")
        num_terminal = 0
        for reward in self.rewards:
            if not math.isfinite(reward.value):
                raise ValueError(f"{where}: reward {reward} is not finite")
            if not 0 <= reward.turn < len(self.turns):
                raise ValueError(f"{where}: reward {reward} names a missing turn")
            if reward.position != self.turns[reward.turn].action_end - 1:
                raise ValueError(f"{where}: reward {reward} is not on the last token of its action span")
            num_terminal += reward.kind == RewardKind.TERMINAL
            if reward.kind == RewardKind.TERMINAL and reward.turn != len(self.turns) - 1:
                raise ValueError(f"{where}: terminal reward {reward} is not on the last turn")
        if num_terminal > 1:
            raise ValueError(f"{where}: {num_terminal} terminal rewards")
        if self.status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED) and not self.turns:
            raise ValueError(f"{where}: a {self.status} trajectory needs at least one action")
        if self.routed_experts is not None:
            if not isinstance(self.routed_experts, RoutedExperts):
                kind = type(self.routed_experts).__name__
                raise ValueError(f"{where}: routed_experts is a {kind}, not RoutedExperts")
            if self.routed_experts.num_tokens != n:
                raise ValueError(f"{where}: routed_experts has {self.routed_experts.num_tokens} entries for {n} tokens")
            try:
                self.routed_experts.check()
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
