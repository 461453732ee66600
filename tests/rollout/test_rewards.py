"""Reward functions, the SafeReward wrapper and the registry."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest

from megatron_sao.rollout.environment import PromptSample
from megatron_sao.rollout.rewards import (
    RewardInput,
    SafeReward,
    answers,
    exact_match,
    extract_boxed,
    math_equivalence,
    register_reward,
    registered_rewards,
    resolve_reward,
    sympy_equivalent,
)
from megatron_sao.rollout.rewards.remote import RemoteRewardModel


def _inp(response: str, answer: str | None = "42", prompt_id: str = "p0") -> RewardInput:
    sample = PromptSample(prompt_id=prompt_id, messages=[{"role": "user", "content": "q"}], answer=answer)
    return RewardInput(sample=sample, response=response)


def test_extract_boxed() -> None:
    assert extract_boxed(r"so \boxed{x^{2}} or rather \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{ 7 } then \boxed{unclosed") == "7"
    assert extract_boxed(r"\boxed{a} and \fbox{b}") == "b"
    assert extract_boxed("no answer here") is None


@pytest.mark.parametrize(("response", "gold", "expected"), [
    (r"The answer is \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{\{2, 1\}}", r"\{1,2\}", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{4}", "3", 0.0),
    ("3, without a box", "3", 0.0),
])
def test_math_equivalence(response: str, gold: str, expected: float) -> None:
    assert math_equivalence(_inp(response, gold)) == expected


def test_math_equivalence_falls_back_to_sympy(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(predicted: str, gold: str) -> bool:
        raise RuntimeError("math-verify unavailable")

    monkeypatch.setattr(answers, "_math_verify_equivalent", broken)
    assert math_equivalence(_inp(r"\boxed{2\sqrt{2}}", r"\sqrt{8}")) == 1.0
    assert math_equivalence(_inp(r"\boxed{0.5}", r"\dfrac{1}{2}")) == 1.0
    assert math_equivalence(_inp(r"\boxed{3}", "4")) == 0.0


def test_sympy_fallback_never_evaluates_model_text(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    assert not sympy_equivalent(f"__import__('os').system('touch {marker}')", "0")
    assert not sympy_equivalent("(1).real", "1")
    assert not marker.exists()
    start = time.monotonic()
    assert not sympy_equivalent("9^{9^{9}}", "1") and not sympy_equivalent("9^9^9^9", "1")
    assert time.monotonic() - start < 2.0  # refused, not evaluated
    assert sympy_equivalent(r"\pi/2", "1.5707963267948966")


def test_exact_match() -> None:
    assert exact_match(_inp(r"  \boxed{ Paris }  ", "Paris")) == 1.0
    assert exact_match(_inp("$42$.", "42")) == 1.0
    assert exact_match(_inp(r"\boxed{paris}", "Paris")) == 0.0
    assert exact_match(_inp(r"\boxed{paris}", "Paris"), case_sensitive=False) == 1.0


# --- SafeReward -------------------------------------------------------------------------------

def _raises(inp: RewardInput) -> float:
    raise KeyError("bug in reward code")


def _sleeps_forever(inp: RewardInput) -> float:
    time.sleep(3600)
    return 1.0


def _dies(inp: RewardInput) -> float:
    os._exit(3)


def _main_thread_check(inp: RewardInput) -> float:
    import threading

    return 1.0 if threading.current_thread() is threading.main_thread() else 0.0


def test_safe_reward_turns_failures_into_outcomes(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        failing = SafeReward(_raises, name="buggy")
        with caplog.at_level(logging.WARNING):
            outcome = await failing(_inp("x", prompt_id="row-7"))
        assert not outcome.ok and outcome.reward is None
        assert outcome.error == "KeyError: 'bug in reward code'"
        assert failing.stats.num_failed == 1 and failing.stats.failures == {"exception:KeyError": 1}
        assert "reward 'buggy' failed on prompt 'row-7'" in caplog.text

        for value, kind in [("1.0", "bad_value"), (float("nan"), "bad_value"), (None, "bad_value")]:
            wrapper = SafeReward(lambda inp, v=value: v)
            outcome = await wrapper(_inp("x"))
            assert not outcome.ok and wrapper.stats.failures == {kind: 1}, value
        assert (await SafeReward(lambda inp: True)(_inp("x"))).reward == 1.0

        missing_answer = SafeReward(math_equivalence)
        outcome = await missing_answer(_inp(r"\boxed{1}", answer=None))
        assert not outcome.ok and "has no reference answer" in (outcome.error or "")

        async def slow(inp: RewardInput) -> float:
            await asyncio.sleep(10)
            return 1.0

        timed = SafeReward(slow, timeout_s=0.2)
        outcome = await timed(_inp("x"))
        assert outcome.error == "timed out after 0.2 s" and timed.stats.failures == {"timeout": 1}

        ok = SafeReward(math_equivalence)
        outcome = await ok(_inp(r"\boxed{42}"))
        assert outcome.ok and outcome.reward == 1.0 and ok.stats.num_ok == 1

    asyncio.run(main())


def test_safe_reward_process_pool_survives_hangs_and_crashes() -> None:
    async def main() -> None:
        hang = SafeReward(_sleeps_forever, timeout_s=1.0, processes=1)
        assert (await hang(_inp("x"))).error == "timed out after 1 s"
        hang.fn = _main_thread_check  # the killed pool is replaced on the next call
        assert (await hang(_inp("x"))).reward == 1.0  # math-verify's SIGALRM timeouts work here
        hang.close()

        crash = SafeReward(_dies, timeout_s=30.0, processes=1)
        outcome = await crash(_inp("x"))
        assert not outcome.ok and crash.stats.failures == {"worker_died": 1}
        crash.fn = math_equivalence
        assert (await crash(_inp(r"\boxed{42}"))).reward == 1.0
        crash.close()

    asyncio.run(main())


# --- registry ---------------------------------------------------------------------------------

def _constant_reward(inp: RewardInput) -> float:
    return 0.25


class _Scaled:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, inp: RewardInput) -> float:
        return self.scale


def test_registry() -> None:
    assert {"math", "exact_match", "remote"} <= set(registered_rewards())
    assert resolve_reward("math") is math_equivalence
    insensitive = resolve_reward("exact_match", case_sensitive=False)
    assert insensitive(_inp(r"\boxed{ABC}", "abc")) == 1.0
    remote = resolve_reward("remote", url="http://127.0.0.1:1/score")
    assert isinstance(remote, RemoteRewardModel) and remote.url == "http://127.0.0.1:1/score"
    assert resolve_reward(f"{__name__}:_constant_reward")(_inp("x")) == 0.25
    assert resolve_reward(f"{__name__}:_Scaled", scale=0.5)(_inp("x")) == 0.5
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="bad arguments"):
        resolve_reward("math", strictness=3)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math", lambda: math_equivalence)
