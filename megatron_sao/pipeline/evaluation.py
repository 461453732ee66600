"""Evaluation during training: held-out prompts rolled out on the run's own engines between
batches, while the training rollouts keep going (`eval.every_n_steps`, `eval.num_prompts`).

`HeldoutEvaluator` lives where the rollout lives (`RolloutHost`: a thread of trainer rank 0 or the
rollout's Ray actor) and runs on its asyncio loop, through the same `EnginePool` as the agent loop
that feeds the ready buffer: an evaluation is one more set of trajectories in flight, limited to
half of the pool's slots so that the training rollouts are slowed, never stopped. Its trajectories
go nowhere near the buffer (never trained on, not in the rollout accounting). Trainer rank 0
(`EngineSource`) starts one after every `every_n_steps`-th step (and once before the first, for
the starting policy) unless one is still running, and picks up finished ones after later steps:

    eval/success      share of the prompts whose episode earned reward 1 (graded tasks: full marks)
    eval/reward       mean total reward
    eval/step         the train step after which it started (the policy it evaluates; curves use it)
    eval/actor_version, eval/num_prompts, eval/seconds
    eval/skipped      evaluations not started because the previous one was still running (cumulative)
    eval/multi_version_frac   share of its episodes sampled by several actor versions (weights
                              change mid-episode under partial rollout; small when evaluations are short)
    eval/success/<tier>       per `metadata["tier"]`, when the prompts carry one (the calc tiers)

The last step waits for an evaluation of the final policy, so the run's last metrics row holds it.
When two evaluations finish within one step, its row keeps the later one.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from megatron_sao.rollout.environment import PromptSample
from megatron_sao.rollout.serving import Runner, run_episodes
from megatron_sao.rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

FINAL_EVAL_WAIT_S = 1800.0
"""How long the last step waits for the final policy's evaluation."""


def eval_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """`eval/success`, `eval/reward`, `eval/multi_version_frac` and per-tier success of one
    evaluation's trajectories (failed episodes count as unsolved with their recorded reward)."""
    n = len(trajectories)
    if n == 0:
        return {}
    solved = [t.total_reward >= 1.0 for t in trajectories]
    out = {"eval/success": sum(solved) / n, "eval/reward": sum(t.total_reward for t in trajectories) / n,
           "eval/multi_version_frac": sum(len(set(t.action_versions())) > 1 for t in trajectories) / n,
           "eval/num_prompts": float(n)}
    tiers: dict[str, list[bool]] = {}
    for t, ok in zip(trajectories, solved, strict=True):
        if "tier" in t.metadata:
            tiers.setdefault(str(t.metadata["tier"]), []).append(ok)
    out.update({f"eval/success/{tier}": sum(v) / len(v) for tier, v in sorted(tiers.items())})
    return out


class HeldoutEvaluator:
    """Evaluations of `samples` with `agent` (a `rollout.serving.Runner` on the run's engine pool:
    the agent loop, or the scaffold runner for a gateway environment), one at a time, each started
    on the rollout thread's loop by `submit` (`RolloutService.submit`). `start`, `finished` and
    `stop` are called from other threads."""

    def __init__(self, samples: Sequence[PromptSample], agent: Runner,
                 submit: Callable[[Coroutine[Any, Any, Any]], concurrent.futures.Future]) -> None:
        if not samples:
            raise ValueError("evaluation during training needs at least one held-out prompt")
        self.samples = list(samples)
        self.agent = agent
        self.submit = submit
        self._running: Any = None  # concurrent.futures.Future of the evaluation in flight
        self._done: list[dict[str, float]] = []
        self.skipped = 0
        """Evaluations not started because the previous one was still running."""

    @property
    def busy(self) -> bool:
        return self._running is not None and not self._running.done()

    def start(self, step: int, actor_version: int) -> bool:
        """Start evaluating the policy as it is after `step`; False (counted) if one is running."""
        if self.busy:
            self.skipped += 1
            return False
        self._collect()
        self._running = self.submit(self._evaluate(step, actor_version))
        return True

    def finished(self, wait_s: float = 0.0) -> list[dict[str, float]]:
        """Metrics of the evaluations finished since the last call, oldest first; with `wait_s`,
        wait up to that long for the one in flight first."""
        if wait_s > 0 and self._running is not None:
            try:
                self._running.result(timeout=wait_s)
            except concurrent.futures.TimeoutError:
                logger.warning("evaluation still running after %.0f s; its result is dropped at the end", wait_s)
            except Exception:  # reported by _collect
                pass
        self._collect()
        done, self._done = self._done, []
        return [{**m, "eval/skipped": float(self.skipped)} for m in done]

    def _collect(self) -> None:
        if self._running is None or not self._running.done():
            return
        future, self._running = self._running, None
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:  # an evaluation must not stop the run: say so, train on
            logger.warning("evaluation during training failed: %r", error)
            return
        self._done.append(future.result())

    async def _evaluate(self, step: int, actor_version: int) -> dict[str, float]:
        start = time.perf_counter()
        # One trajectory per episode (a scaffold episode's last segment), at most
        # max_concurrent_trajectories at once.
        trajectories = await run_episodes(self.agent, self.samples)
        metrics = eval_metrics(trajectories)
        metrics.update({"eval/step": float(step), "eval/actor_version": float(actor_version),
                        "eval/seconds": time.perf_counter() - start})
        logger.info("evaluation after step %d: success %.3f, reward %.3f (%d prompts, %.1f s)", step,
                    metrics["eval/success"], metrics["eval/reward"], len(trajectories), metrics["eval/seconds"])
        return metrics

    def stop(self) -> None:
        """Cancel the evaluation in flight and close the runner (a scaffold runner's gateway): the
        rollout is stopping."""
        if self._running is not None:
            self._running.cancel()
            self._running = None
        close = getattr(self.agent, "close", None)
        if close is not None:
            try:
                self.submit(close()).result(timeout=30)
            except Exception as error:  # stopping goes on: the rollout's loop ends next
                logger.warning("closing the evaluation's runner: %r", error)


def make_evaluator(config: Any, tokenizer: Any, pool: Any,
                   submit: Callable[[Coroutine[Any, Any, Any]], concurrent.futures.Future],
                   env_factory: Callable[[PromptSample], Any]) -> HeldoutEvaluator | None:
    """The run's evaluator (None when `eval.every_n_steps` is 0): the first `eval.num_prompts` of
    `eval.prompts_path`, rolled out with the training rollouts' agent settings, at most half of the
    pool's slots at once."""
    import dataclasses

    from megatron_sao.rollout.datasets import DatasetConfig, load_prompts
    from megatron_sao.rollout.gateway.runner import make_runner
    from megatron_sao.rollout.settings import agent_loop_config_from

    e = config.eval
    if not e.every_n_steps:
        return None
    dataset = load_prompts(e.prompts_path, DatasetConfig(max_prompt_chars=config.data.max_prompt_chars))
    samples = dataset.samples[: e.num_prompts]
    capacity = pool.max_inflight_per_engine * len(pool.clients)
    agent_config = dataclasses.replace(agent_loop_config_from(config),
                                       max_concurrent_trajectories=max(1, capacity // 2))
    logger.info("evaluation during training: %d prompts of %s every %d steps", len(samples), e.prompts_path,
                e.every_n_steps)
    # The runner that fits the environment, as for the training rollouts (`rollout/serving.py`): a
    # scaffold environment gets a gateway of its own for the evaluation's sessions.
    return HeldoutEvaluator(samples, make_runner(agent_config, tokenizer, pool, env_factory), submit)
