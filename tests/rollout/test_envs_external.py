"""The external-environment adapter: the worked example end to end, a program that supplies its
own prompt and tools, and every protocol failure becoming an `ExternalEnvError` (never a hang,
never a leaked process). Each test runs reset, steps and close in one event loop: the process
belongs to the loop that started it."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from megatron_sao.rollout.environment import TRUNCATION_REASON_KEY, PromptSample
from megatron_sao.rollout.envs import make_env_factory
from megatron_sao.rollout.envs.external import ExternalEnvError, SubprocessEnvConfig, SubprocessEnvironment


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    """Every environment process started by a test is gone when it ends (children that existed
    before, such as multiprocessing's resource tracker, are not ours to judge)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    leaked = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert leaked == []


def _sample(secret: int = 37) -> PromptSample:
    return PromptSample(prompt_id="g1", messages=[{"role": "user", "content": "Guess my number (1-100)."}],
                        answer=str(secret))


def test_guess_number_example_with_a_binary_search_policy() -> None:
    factory = make_env_factory("guess_number", reply_timeout_s=30.0)
    sample = _sample(37)
    env = factory(sample)

    async def play() -> list:
        results, low, high = [], 1, 100
        try:
            assert await env.reset(sample) == sample.messages
            assert env.tools is None
            while True:
                guess = (low + high) // 2
                result = await env.step(f"My guess is {guess}.")
                results.append(result)
                if result.done:
                    return results
                assert result.role == "user"
                low, high = (guess + 1, high) if "higher" in result.observation else (low, guess - 1)
        finally:
            await env.close()

    results = asyncio.run(play())
    assert [r.observation for r in results[:2]] == ["50 is wrong; the number is lower.",
                                                    "25 is wrong; the number is higher."]
    final = results[-1]
    assert final.done and not final.truncated and final.info["guesses"] == len(results)
    assert final.reward == pytest.approx(max(0.1, 1.0 - 0.1 * (len(results) - 1)))


def test_running_out_of_guesses_is_a_truncation() -> None:
    env = make_env_factory("guess_number")(_sample(37))

    async def run() -> list:
        try:
            await env.reset(_sample(37))
            return [await env.step("1") for _ in range(10)]
        finally:
            await env.close()

    results = asyncio.run(run())
    assert not any(r.done for r in results[:-1])
    assert results[-1].done and results[-1].truncated and results[-1].reward == 0.0
    assert results[-1].info[TRUNCATION_REASON_KEY] == "max_guesses"


def test_no_number_gets_a_hint_and_close_without_steps_is_fine() -> None:
    factory = make_env_factory("guess_number")
    env = factory(_sample())

    async def run() -> str:
        try:
            await env.reset(_sample())
            return (await env.step("hmm, let me think")).observation
        finally:
            await env.close()

    assert asyncio.run(run()) == "Reply with a whole number."
    idle = factory(_sample())
    asyncio.run(idle.close())  # never reset, so never started: nothing to do

    async def reset_then_close() -> None:
        reset_only = factory(_sample())
        await reset_only.reset(_sample())
        await reset_only.close()

    asyncio.run(reset_then_close())  # the process started by reset is gone (no_leaked_children)


def _script_env(body: str, timeout_s: float = 5.0) -> SubprocessEnvironment:
    """An environment process running `body` (Python), possibly misbehaving."""
    return SubprocessEnvironment(SubprocessEnvConfig(command=(sys.executable, "-c", body), reply_timeout_s=timeout_s))


ACK_RESET = "import sys, json, time\nsys.stdin.readline(); print(json.dumps({'ok': True}), flush=True)\n"


def _reset_reply(reply: dict) -> str:
    """A program that answers reset with `reply`, then echoes each action as its observation."""
    return ("import sys, json\n"
            f"sys.stdin.readline(); print(json.dumps({reply!r}), flush=True)\n"
            "for line in sys.stdin:\n"
            "    request = json.loads(line)\n"
            "    if request['op'] == 'close':\n"
            "        print(json.dumps({'ok': True}), flush=True); break\n"
            "    print(json.dumps({'observation': request['action']}), flush=True)\n")


OWN_PROMPT = [{"role": "system", "content": "You are in /repo."}, {"role": "user", "content": "Fix the failing test."}]
BASH_PARAMETERS = {"type": "object", "properties": {"cmd": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "bash", "description": "Run a command.", "parameters": BASH_PARAMETERS}}]


def test_the_program_can_supply_its_own_prompt_and_tools() -> None:
    env = _script_env(_reset_reply({"ok": True, "messages": OWN_PROMPT, "tools": TOOLS}))

    async def run() -> tuple[list, list | None, str]:
        try:
            messages = await env.reset(_sample())
            return messages, env.tools, (await env.step("ls")).observation
        finally:
            await env.close()

    assert asyncio.run(run()) == (OWN_PROMPT, TOOLS, "ls")


async def _reset_then_step(env: SubprocessEnvironment) -> None:
    try:
        await env.reset(_sample())
        await env.step("42")
    finally:
        await env.close()


RESET_FAILURES = [
    ("print('hello', flush=True)", "reply to 'reset' is not JSON"),
    ("import sys; sys.stdin.readline(); sys.exit(3)", "exited (code 3) before answering 'reset'"),
    ("import sys; sys.stdin.readline(); print('{\"error\": \"no such task\"}', flush=True)",
     "reported an error on 'reset': no such task"),
    ("import sys, time; sys.stdin.readline(); time.sleep(60)", "no reply to 'reset' within 1 s"),
    (_reset_reply({"ready": True}), "reset was not acknowledged"),
    (_reset_reply({"ok": True, "messages": []}), "messages must be a non-empty list"),
    (_reset_reply({"ok": True, "messages": [{"role": "user"}]}), "messages must be a non-empty list"),
    (_reset_reply({"ok": True, "tools": {"name": "bash"}}), "tools must be a list"),
]
STEP_FAILURES = [
    (ACK_RESET + "sys.stdin.readline(); print('[1]', flush=True)", "reply to 'step' is not an object"),
    (ACK_RESET + "sys.stdin.readline(); print(json.dumps({'observation': 1}), flush=True)", "wrong shape"),
    (ACK_RESET + "sys.stdin.readline(); print(json.dumps({'done': 'yes'}), flush=True)", "wrong shape"),
    (ACK_RESET + "sys.stdin.readline(); print(json.dumps({'truncated': True}), flush=True)", "truncated needs done"),
    (ACK_RESET + "sys.stdin.readline(); time.sleep(60)", "no reply to 'step' within 1 s"),
]


@pytest.mark.parametrize(("body", "message"), RESET_FAILURES)
def test_reset_failures_raise_from_reset_and_leave_no_process(body: str, message: str) -> None:
    env = _script_env(body, timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(ExternalEnvError, match=re.escape(message)):
        asyncio.run(env.reset(_sample()))  # no close(): the failed reset cleaned up by itself
    assert env._proc is None  # (no_leaked_children checks the process is gone)
    assert time.monotonic() - start < 8.0


@pytest.mark.parametrize(("body", "message"), STEP_FAILURES)
def test_step_failures_raise_external_env_error(body: str, message: str) -> None:
    env = _script_env(body, timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(ExternalEnvError, match=re.escape(message)):
        asyncio.run(_reset_then_step(env))
    assert time.monotonic() - start < 8.0


def test_close_kills_a_process_that_ignores_it() -> None:
    env = _script_env(ACK_RESET + "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "sys.stdin.readline(); print(json.dumps({'observation': 'x'}), flush=True)\n"
                      "time.sleep(600)\n")

    async def run() -> str:
        await env.reset(_sample())
        result = await env.step("1")
        await env.close()
        return result.observation

    start = time.monotonic()
    assert asyncio.run(run()) == "x"
    assert time.monotonic() - start < 10.0


def test_configuration_errors() -> None:
    with pytest.raises(ValueError, match="command is empty"):
        SubprocessEnvConfig(command=())
    env = make_env_factory("subprocess", command="/nonexistent/program --flag")(_sample())
    with pytest.raises(ExternalEnvError, match="cannot start /nonexistent/program --flag"):
        asyncio.run(env.reset(_sample()))


def test_registry() -> None:
    from megatron_sao.rollout.envs import register_environment, registered_environments
    from megatron_sao.rollout.envs.calc import CalcEnv

    assert {"math_python", "calc", "subprocess", "guess_number"} <= set(registered_environments())
    assert isinstance(make_env_factory("megatron_sao.rollout.envs.calc:CalcEnv")(_sample()), CalcEnv)
    assert isinstance(make_env_factory("megatron_sao.rollout.envs.calc:make_calc", max_turns=2)(_sample()), CalcEnv)
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        make_env_factory("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        make_env_factory("megatron_sao.rollout.envs.calc:Missing")
    with pytest.raises(ValueError, match="bad arguments"):
        make_env_factory("calc", turns=3)
    with pytest.raises(ValueError, match="already registered"):
        register_environment("calc", "x:y")
