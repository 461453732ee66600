"""The async multi-turn agent loop: environments x engines -> trajectories.

For one prompt: `await env.reset(sample)`, render its messages (and the tools it declares,
`env.tools`) with the chat template, then repeat {generate one assistant turn token-in /
token-out (stop at the EOS / `<|im_end|>` token), record its tokens with the engine's log-probs
and per-token weight versions (loss_mask 1), decode the action text, `env.step` it, append the
observation as the template renders it (loss_mask 0)} until the environment says done
(COMPLETED; TRUNCATED when it says `truncated`, its own limit) or a turn / token limit of the
loop is reached (TRUNCATED).
Many trajectories run at once (`max_concurrent_trajectories`); every generate call goes through
the `EnginePool`, so turns spread over engines by load.

Failure handling, one trajectory at a time (the loop itself never raises for them):
- an environment or reward exception -> FAILED with the exception as `status_reason`; an
  environment may also report a caught failure (a reward function that raised) by putting a
  reason string under `StepResult.info["reward_error"]` or `["failure"]` (`FAILURE_INFO_KEYS`);
- an engine that crashes mid-call -> the call is re-sent to a healthy engine (the tokens so far
  are exact, so the trajectory continues where it was; `num_engine_retries` counts it);
- an engine-side abort (`pause_generation(mode="abort")` for a weight update, `abort_request`)
  -> the partial turn is kept and generation resumes from it (`resume_on_engine_abort`); after
  `AgentLoop.abort()` -> ABORTED.
Routing (R3, `AgentLoopConfig.routing`): every call asks the engine for the routed experts of the
positions the trajectory has no routing for yet (`routed_experts_start_len`), so each token keeps
the routing of the forward that first computed it, also across weight updates and re-sent calls;
the record holds them in `Trajectory.routed_experts` (rollout/routing.py).
Rewards: a per-turn reward on the last token of its action span, the terminal reward (with
done) on the last action token. Who ends the episode scores it: a trajectory the loop truncates
gets `truncation_reward` as terminal; one the environment ends with `truncated=True` keeps the
environment's reward (it judged the episode when it cut it short).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from megatron_sao.rollout.chat_format import ChatFormat
from megatron_sao.rollout.client import EngineError, EngineUnavailableError, GenerateOutput, SamplingParams
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.environment import TRUNCATION_REASON_KEY, Environment, PromptSample, StepResult
from megatron_sao.rollout.routing import RoutingSpec, decode_sglang_routed_experts
from megatron_sao.rollout.trajectory import FinishType, RewardKind, Trajectory, TrajectoryStatus

logger = logging.getLogger(__name__)

FAILURE_INFO_KEYS = ("failure", "reward_error")
"""`StepResult.info[key] = "reason"` for any of these keys marks the trajectory FAILED with
reason `"{key}: {reason}"`. "reward_error" is `rewards.base.REWARD_ERROR_KEY`: an environment
whose reward function failed (`SafeReward` caught it) reports it there."""


@dataclass(kw_only=True, slots=True)
class AgentLoopConfig:
    max_turns: int = 8
    """Assistant turns per trajectory; reaching it without done -> TRUNCATED ("max_turns")."""
    max_total_tokens: int = 8192
    """Prompt + actions + observations; reaching it -> TRUNCATED ("max_total_tokens")."""
    max_new_tokens_per_turn: int = 2048
    """Tokens one assistant turn may sample; reaching it -> TRUNCATED ("max_new_tokens_per_turn")."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] | None = None
    """Tokens that end an assistant turn; None: the tokenizer's EOS (`<|im_end|>` for Qwen)."""
    max_concurrent_trajectories: int = 256
    max_engine_retries: int = 16
    """Re-sent generate calls per trajectory (engine crash or engine-side abort) before FAILED."""
    resume_on_engine_abort: bool = True
    """Continue a turn whose generate call an engine aborted (keeping the partial tokens)."""
    truncation_reward: float | None = 0.0
    """Terminal reward recorded when the loop truncates a trajectory (one of its limits); None
    records none. An environment that truncates (`StepResult.truncated`) gives its own reward."""
    env_step_timeout_s: float | None = None
    """Time limit of one `env.step`; exceeding it -> FAILED ("env_step_timeout")."""
    routing: RoutingSpec | None = None
    """Ask the engines for routed experts and record them (`Trajectory.routed_experts`) in this
    model's layout; None: no routing (engines must run with `--enable-return-routed-experts`)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_new_tokens_per_turn", "max_concurrent_trajectories"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentLoopConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_engine_retries < 0:
            raise ValueError(f"AgentLoopConfig.max_engine_retries must be >= 0, got {self.max_engine_retries}")


@dataclass(slots=True)
class AgentLoopStats:
    """Counts by final status, failure reasons by category (the text before the first ':')."""

    by_status: collections.Counter = field(default_factory=collections.Counter)
    failure_reasons: collections.Counter = field(default_factory=collections.Counter)
    engine_retries: int = 0
    action_tokens: int = 0

    def record(self, traj: Trajectory) -> None:
        self.by_status[str(traj.status)] += 1
        if traj.status == TrajectoryStatus.FAILED:
            self.failure_reasons[traj.status_reason.split(":", 1)[0]] += 1
        self.engine_retries += traj.num_engine_retries
        self.action_tokens += traj.num_action_tokens


class _Stop(Exception):
    """Ends a trajectory with a status (internal control flow of `run_trajectory`)."""

    def __init__(self, status: TrajectoryStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def parse_policy_version(label: str) -> int:
    """Engine weight-version labels are the integer policy versions written by the pipeline."""
    try:
        version = int(label)
    except ValueError:
        raise ValueError(
            f"engine weight_version {label!r} is not an integer policy version; launch engines with "
            "--weight-version 0 (the launcher does) and label every weight update with an integer"
        ) from None
    if version < 0:
        raise ValueError(f"engine weight_version {label!r} is negative")
    return version


class AgentLoop:
    def __init__(
        self,
        config: AgentLoopConfig,
        tokenizer,
        pool: EnginePool,
        env_factory: Callable[[PromptSample], Environment],
    ) -> None:
        self.config = config
        self.pool = pool
        self.env_factory = env_factory
        self.chat = ChatFormat(tokenizer, config.stop_token_ids)
        self.stats = AgentLoopStats()
        self._aborting = False

    # ---- many trajectories ------------------------------------------------------------------

    async def iter_trajectories(
        self, samples: Iterable[PromptSample] | AsyncIterable[PromptSample]
    ) -> AsyncIterator[Trajectory]:
        """Run `samples` with at most `max_concurrent_trajectories` in flight; yield each
        trajectory the moment it finishes (completion order, not input order)."""
        if isinstance(samples, AsyncIterable):
            source = aiter(samples)

            async def next_sample() -> PromptSample | None:
                return await anext(source, None)
        else:
            sync_source = iter(samples)

            async def next_sample() -> PromptSample | None:
                return next(sync_source, None)

        pending: set[asyncio.Task[Trajectory]] = set()
        exhausted = False
        try:
            while True:
                while not exhausted and not self._aborting and len(pending) < self.config.max_concurrent_trajectories:
                    sample = await next_sample()
                    if sample is None:
                        exhausted = True
                        break
                    pending.add(asyncio.create_task(self.run_trajectory(sample)))
                if not pending:
                    return
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    yield task.result()
        finally:
            for task in pending:
                task.cancel()

    async def run(self, samples: Iterable[PromptSample] | AsyncIterable[PromptSample]) -> list[Trajectory]:
        return [traj async for traj in self.iter_trajectories(samples)]

    async def abort(self) -> None:
        """Stop starting trajectories and abort the generate calls in flight on every engine; the
        running trajectories end ABORTED."""
        self._aborting = True
        await self.pool.abort_all()

    # ---- one trajectory ---------------------------------------------------------------------

    async def run_trajectory(self, sample: PromptSample) -> Trajectory:
        traj = Trajectory(prompt_id=sample.prompt_id, metadata=dict(sample.metadata))
        traj.timings.started_at = time.time()
        env: Environment | None = None
        try:
            env = self.env_factory(sample)
            await self._episode(env, sample, traj)
        except _Stop as stop:
            traj.finish(stop.status, stop.reason)
        except Exception as e:  # a bug must cost one trajectory, not the rollout
            logger.exception("trajectory %s (prompt %s) failed unexpectedly", traj.trajectory_id, sample.prompt_id)
            traj.finish(TrajectoryStatus.FAILED, f"internal_error: {e!r}")
        finally:
            if env is not None:
                try:
                    await env.close()
                except Exception as e:
                    logger.warning("env.close() raised for prompt %s: %r", sample.prompt_id, e)
                    traj.metadata["env_close_error"] = repr(e)
            traj.timings.finished_at = time.time()
        self.stats.record(traj)
        return traj

    def _check_abort(self) -> None:
        if self._aborting:
            raise _Stop(TrajectoryStatus.ABORTED, "aborted")

    def _truncate(self, traj: Trajectory, reason: str) -> _Stop:
        if self.config.truncation_reward is not None and traj.turns:
            traj.add_reward(self.config.truncation_reward, RewardKind.TERMINAL)
        return _Stop(TrajectoryStatus.TRUNCATED, reason)

    async def _episode(self, env: Environment, sample: PromptSample, traj: Trajectory) -> None:
        cfg = self.config
        messages, tools = await self._reset(env, sample, traj)
        traj.set_prompt(self.chat.encode_prompt(messages, tools))
        if len(traj) >= cfg.max_total_tokens:
            raise _Stop(TrajectoryStatus.FAILED, f"prompt_too_long: {len(traj)} >= max_total_tokens")
        while True:
            self._check_abort()
            hit_turn_limit = await self._generate_turn(traj)
            turn = traj.turns[-1]
            action_ids = traj.token_ids[turn.action_start : turn.action_end]
            if not self.chat.ends_with_stop(action_ids):
                if turn.finish_type == FinishType.STOP:  # an engine EOS that is not a turn stop
                    raise self._truncate(traj, f"unexpected_stop_token: {action_ids[-1]}")
                raise self._truncate(traj, "max_new_tokens_per_turn" if hit_turn_limit else "max_total_tokens")
            turn.finish_type = FinishType.STOP
            result = await self._step(env, self.chat.decode_action(action_ids), traj)
            for key in FAILURE_INFO_KEYS:
                if result.info.get(key):
                    raise _Stop(TrajectoryStatus.FAILED, f"{key}: {result.info[key]}")
            _keep_info(traj, result)
            if result.done:  # a finished episode is kept even if an abort came meanwhile
                traj.add_reward(result.reward, RewardKind.TERMINAL)
                if result.truncated:
                    reason = result.info.get(TRUNCATION_REASON_KEY)
                    raise _Stop(TrajectoryStatus.TRUNCATED, f"env_truncated: {reason}" if reason else "env_truncated")
                raise _Stop(TrajectoryStatus.COMPLETED, "done")
            self._check_abort()
            if result.reward != 0.0:
                traj.add_reward(result.reward, RewardKind.TURN)
            if len(traj.turns) >= cfg.max_turns:
                raise self._truncate(traj, "max_turns")
            observation = self.chat.encode_observation(result.observation, result.role, action_ids, tools)
            if len(traj) + len(observation) >= cfg.max_total_tokens:
                raise self._truncate(traj, "max_total_tokens")
            traj.append_observation(observation)

    async def _reset(
        self, env: Environment, sample: PromptSample, traj: Trajectory
    ) -> tuple[list[dict[str, str]], list[dict] | None]:
        """The episode's prompt messages and declared tools; any failure -> FAILED env_reset_error.
        Its time counts in `env_s` (an environment may start a sandbox or container here)."""
        start = time.perf_counter()
        try:
            messages = await env.reset(sample)
            tools = env.tools
        except Exception as e:
            raise _Stop(TrajectoryStatus.FAILED, f"env_reset_error: {e!r}") from e
        finally:
            traj.timings.env_s += time.perf_counter() - start
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            reason = f"env_reset_error: tools must be None or a list of dicts, got {tools!r:.80}"
            raise _Stop(TrajectoryStatus.FAILED, reason)
        return messages, tools

    async def _step(self, env: Environment, action_text: str, traj: Trajectory) -> StepResult:
        start = time.perf_counter()
        try:
            if self.config.env_step_timeout_s is None:
                result = await env.step(action_text)
            else:
                result = await asyncio.wait_for(env.step(action_text), self.config.env_step_timeout_s)
        except TimeoutError as e:
            if self.config.env_step_timeout_s is None:  # raised by the environment itself
                raise _Stop(TrajectoryStatus.FAILED, f"env_step_error: {e!r}") from e
            raise _Stop(TrajectoryStatus.FAILED, f"env_step_timeout: > {self.config.env_step_timeout_s} s") from e
        except Exception as e:
            raise _Stop(TrajectoryStatus.FAILED, f"env_step_error: {e!r}") from e
        finally:
            traj.timings.env_s += time.perf_counter() - start
        if not isinstance(result, StepResult):
            raise _Stop(TrajectoryStatus.FAILED, f"env_step_error: step returned {type(result).__name__}")
        return result

    async def _generate_turn(self, traj: Trajectory) -> bool:
        """Sample one assistant turn into `traj` (resuming after engine aborts and re-sending
        after engine crashes). Returns True when the turn hit `max_new_tokens_per_turn`."""
        cfg = self.config
        turn_tokens = 0
        turn_empty = True
        while True:
            budget = cfg.max_total_tokens - len(traj)
            turn_left = cfg.max_new_tokens_per_turn - turn_tokens
            if not turn_empty and (budget <= 0 or turn_left <= 0):
                return turn_left <= 0
            params = SamplingParams(
                max_new_tokens=min(budget, turn_left),
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                stop_token_ids=self.chat.stop_token_ids,
                skip_special_tokens=False,
                no_stop_trim=True,
            )
            input_length = len(traj)
            routed_start = self._routed_start(traj)
            out = await self._call_engine(traj, params, routed_start)
            if out is None:  # re-send (engine went away before answering)
                continue
            if out.output_logprobs is None:
                raise _Stop(TrajectoryStatus.FAILED, "engine_error: the engine returned no log-probs")
            if out.output_ids:
                try:
                    versions = [parse_policy_version(v) for v in out.token_versions()]
                except (ValueError, EngineError) as e:
                    raise _Stop(TrajectoryStatus.FAILED, f"engine_error: {e}") from e
                self._append(traj, out, versions, new_turn=turn_empty)
                turn_tokens += len(out.output_ids)
                turn_empty = False
            self._record_routing(traj, out, routed_start, input_length)
            if out.finish_reason.type == "abort" and not self.chat.ends_with_stop(out.output_ids):
                self._check_abort()
                if not cfg.resume_on_engine_abort:
                    raise _Stop(TrajectoryStatus.ABORTED, f"engine_abort: {out.finish_reason.message}")
                self._count_retry(traj, f"engine_abort: {out.finish_reason.message}")
                continue
            if turn_empty:  # stop / length with no token at all: nothing to train on or credit
                raise _Stop(TrajectoryStatus.FAILED, f"engine_error: empty answer ({out.finish_reason})")
            return out.finish_reason.type == "length" and turn_tokens >= cfg.max_new_tokens_per_turn

    def _append(self, traj: Trajectory, out: GenerateOutput, versions: list[int], new_turn: bool) -> None:
        assert out.output_logprobs is not None
        finish = FinishType(out.finish_reason.type) if out.finish_reason.type in FinishType else FinishType.ABORT
        if new_turn and traj.turns:
            assert traj.turns[-1].observation_end > traj.turns[-1].action_end, "a turn must follow an observation"
        traj.append_action(out.output_ids, out.output_logprobs, versions, finish)

    def _routed_start(self, traj: Trajectory) -> int | None:
        """First position to ask routing for (the ones before it have theirs); None: no routing."""
        if self.config.routing is None:
            return None
        return 0 if traj.routed_experts is None else traj.routed_experts.num_leading_routed()

    def _record_routing(self, traj: Trajectory, out: GenerateOutput, start: int | None, input_length: int) -> None:
        """Keep the answer's routing of positions `[start, input_length + outputs - 1)`."""
        spec = self.config.routing
        if spec is None or start is None or out.routed_experts is None:
            return  # not asked, or an aborted call that returned none (the next call asks again)
        rows = max(0, input_length + len(out.output_ids) - 1 - start)
        try:
            traj.record_routing(start, decode_sglang_routed_experts(out.routed_experts, spec, rows))
        except ValueError as e:
            raise _Stop(TrajectoryStatus.FAILED, f"engine_error: {e}") from e

    def _count_retry(self, traj: Trajectory, reason: str) -> None:
        traj.num_engine_retries += 1
        if traj.num_engine_retries > self.config.max_engine_retries:
            raise _Stop(TrajectoryStatus.FAILED, f"engine_retries_exhausted: {reason}")

    async def _call_engine(self, traj: Trajectory, params: SamplingParams,
                           routed_start: int | None = None) -> GenerateOutput | None:
        async with self.pool.acquire() as client:
            self._check_abort()
            rid = f"{traj.trajectory_id}-{traj.num_engine_calls}"
            traj.num_engine_calls += 1
            start = time.perf_counter()
            try:
                if routed_start is None:
                    return await client.generate(traj.token_ids, params, rid=rid)
                return await client.generate(traj.token_ids, params, rid=rid, return_routed_experts=True,
                                             routed_experts_start_len=routed_start)
            except EngineUnavailableError as e:
                await self.pool.mark_unhealthy(client)
                self._count_retry(traj, f"engine_unavailable: {e.message}")
                return None
            except EngineError as e:
                raise _Stop(TrajectoryStatus.FAILED, f"engine_error: {e.message}") from e
            finally:
                traj.timings.generate_s += time.perf_counter() - start


def _keep_info(traj: Trajectory, result: StepResult) -> None:
    """Keep the latest step's `info` in the record when it is JSON-serialisable."""
    if not result.info:
        return
    try:
        json.dumps(result.info)
    except (TypeError, ValueError):
        return
    traj.metadata["last_step_info"] = result.info
