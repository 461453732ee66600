"""The math-with-Python (TIR) environment, with the real sandbox behind its tool."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from megatron_sao.rollout.environment import PromptSample
from megatron_sao.rollout.envs import make_env_factory
from megatron_sao.rollout.envs.math_python import (
    DEFAULT_SYSTEM_PROMPT,
    PYTHON_TOOL_SCHEMA,
    MathPythonConfig,
    MathPythonEnv,
    MathPythonEnvFactory,
)
from megatron_sao.rollout.rewards import REWARD_ERROR_KEY
from megatron_sao.rollout.sandbox import SandboxConfig

FENCE = "`" * 3


def _call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def _sample(answer: str | None = "1024", messages: list[dict[str, str]] | None = None) -> PromptSample:
    return PromptSample(prompt_id="m1", messages=messages or [{"role": "user", "content": "What is 2^10?"}],
                        answer=answer)


@pytest.fixture(scope="module")
def factory() -> Iterator[MathPythonEnvFactory]:
    f = MathPythonEnvFactory(MathPythonConfig(timeout_s=5.0, max_tool_calls=3),
                             sandbox=SandboxConfig(uid_base=2_030_000_000), max_concurrent_sandboxes=4)
    yield f
    f.close()


def _episode(env: MathPythonEnv, sample: PromptSample, actions: list[str]) -> tuple[list, list]:
    """(prompt messages from reset, step results of `actions`)."""
    async def run() -> tuple[list, list]:
        messages = await env.reset(sample)
        return messages, [await env.step(action) for action in actions]

    return asyncio.run(run())


def test_tool_call_then_boxed_answer(factory: MathPythonEnvFactory) -> None:
    env = factory(_sample())
    messages, (tool, final) = _episode(env, _sample(), ["I will compute. " + _call("x = 2\nx ** 10"),
                                                        r"So \boxed{1024}."])
    assert messages == [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                        {"role": "user", "content": "What is 2^10?"}]
    assert tool.observation == "1024" and not tool.done and tool.role == "tool" and tool.reward == 0.0
    assert final.done and final.reward == 1.0 and final.observation == ""
    assert final.info == {"num_tool_calls": 1, "answer": "1024"}
    assert env.tools == [PYTHON_TOOL_SCHEMA]  # declared to the chat template by default (qwen syntax)


def test_wrong_or_missing_answer_scores_zero(factory: MathPythonEnvFactory) -> None:
    _, (wrong,) = _episode(factory(_sample()), _sample(), [r"\boxed{1000}"])
    assert wrong.done and wrong.reward == 0.0
    _, (missing,) = _episode(factory(_sample()), _sample(), ["I think it is 1024."])
    assert missing.done and missing.reward == 0.0 and missing.info["answer"] is None


def test_failures_become_observations(factory: MathPythonEnvFactory) -> None:
    actions = [
        _call("print('partial')\n1 / 0"),
        _call("while True:\n    pass"),
        "<tool_call>{broken json</tool_call>",
        '<tool_call>{"name": "bash", "arguments": {"code": "ls"}}</tool_call>',
        '<tool_call>{"name": "python", "arguments": {"source": "1"}}</tool_call>',
    ]
    _, (crash, hang, broken, unknown, no_code) = _episode(factory(_sample()), _sample(), actions)
    assert crash.observation.startswith("partial\nTraceback") and "ZeroDivisionError" in crash.observation
    assert crash.observation.endswith("Error: exited with status 1")
    assert hang.observation == "Error: timed out after 5 s"
    assert broken.observation.startswith("Error: tool call is not valid JSON")
    assert unknown.observation == "Error: unknown tool 'bash'; the only tool is 'python'"
    assert no_code.observation == 'Error: the python tool needs a string argument "code"'
    assert not any(r.done for r in (crash, hang, broken, unknown, no_code))


def test_tool_call_limits(factory: MathPythonEnvFactory) -> None:
    many = " ".join(_call(f"print({i})") for i in range(6))
    _, (first, second) = _episode(factory(_sample()), _sample(), [many, _call("print('again')")])
    assert first.observation.split("\n\n") == ["0", "1", "2", "Error: the tool-call limit (3) is reached; "
                                               "give the final answer in \\boxed{}",
                                               "Error: at most 4 tool calls per turn; 2 not run"]
    assert second.observation.startswith("Error: the tool-call limit (3)")


def test_failed_reward_is_reported_not_raised(factory: MathPythonEnvFactory) -> None:
    _, (final,) = _episode(factory(_sample(answer=None)), _sample(answer=None), [r"\boxed{3}"])
    assert final.done and final.reward == 0.0
    assert "has no reference answer" in final.info[REWARD_ERROR_KEY]
    assert factory.reward.stats.failures["exception:ValueError"] >= 1


def test_fenced_syntax_and_own_system_prompt() -> None:
    factory = make_env_factory("math_python", tool_syntax="fenced", timeout_s=5.0,
                               sandbox={"uid_base": 2_030_000_000})
    try:
        own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7?"}]
        sample = _sample(answer="42", messages=own)
        env = factory(sample)
        messages, (tool, final) = _episode(env, sample, [f"{FENCE}python\nprint(6 * 7)\n{FENCE}", r"\boxed{42}"])
        assert messages == own  # a dataset's own system prompt is kept
        assert env.tools is None  # fenced calls are not the template's <tool_call> format
        assert tool.observation == "42" and final.reward == 1.0
    finally:
        factory.close()


def test_concurrent_episodes_share_the_pool(factory: MathPythonEnvFactory) -> None:
    async def one(i: int) -> float:
        sample = _sample(answer=str(i * i))
        env = factory(sample)
        await env.reset(sample)
        observation = (await env.step(_call(f"print({i} * {i})"))).observation
        return (await env.step(f"\\boxed{{{observation.strip()}}}")).reward

    async def many() -> list[float]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    assert asyncio.run(many()) == [1.0] * 8


def test_registry_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="valid options"):
        make_env_factory("math_python", timeout=3)
    with pytest.raises(ValueError, match="tool_syntax"):
        MathPythonConfig(tool_syntax="xml")


@pytest.mark.parametrize(("syntax", "declare", "declared"), [
    ("qwen", None, True), ("both", None, True), ("fenced", None, False), ("qwen", False, False), ("both", True, True),
])
def test_which_configurations_declare_the_tool(syntax: str, declare: bool | None, declared: bool) -> None:
    env = MathPythonEnv(MathPythonConfig(tool_syntax=syntax, declare_tools=declare), pool=None, reward=None)
    assert env.tools == ([PYTHON_TOOL_SCHEMA] if declared else None)
    if declared:  # each episode gets its own copy: an edit cannot leak into other episodes
        env.tools[0]["function"]["name"] = "changed"
        assert PYTHON_TOOL_SCHEMA["function"]["name"] == "python"
    with pytest.raises(ValueError, match="declare_tools"):
        MathPythonConfig(tool_syntax="fenced", declare_tools=True)
