"""Math with a Python tool (the paper's TIR setting): code runs in the sandbox, the final
`\\boxed{}` answer is checked for mathematical equivalence.

Episode: the model writes reasoning and, to compute, a tool call (`tool_calls.py` syntax; the
tool is `python` with argument `code`). Each call runs in a fresh sandbox; its output (or the
error: timeout, memory, exception) comes back as the `tool` observation. A turn with no tool
call is the final answer: the reward (default math equivalence against `PromptSample.answer`)
ends the episode. A reward function that fails ends it with `info["reward_error"]`, which the
agent loop records as a FAILED trajectory. Turn limits belong to the agent loop; this
environment only caps tool calls (`max_tool_calls`), answering over-budget calls with an error
that asks for the final answer. The tool's JSON schema is declared to the chat template
(`Environment.tools`), so Qwen-style templates describe it in the format the model was trained on.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_sao.rollout.environment import Environment, PromptSample, StepResult
from megatron_sao.rollout.envs.tool_calls import SYNTAXES, ToolCall, parse_tool_calls, print_last_expression
from megatron_sao.rollout.rewards import REWARD_ERROR_KEY, RewardInput, SafeReward, extract_boxed, resolve_reward
from megatron_sao.rollout.sandbox import SandboxConfig, SandboxPool

PYTHON_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python 3 script (sympy and numpy available) in a fresh sandbox without network "
                       "access and return its printed output. State does not persist between calls.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}

DEFAULT_SYSTEM_PROMPT = (
    "Solve the problem. You may run Python code with the python tool: write\n"
    '<tool_call>{"name": "python", "arguments": {"code": "print(1 + 1)"}}</tool_call>\n'
    "and you will see what it prints. Each call starts from scratch. When you are done, give the final "
    "answer as \\boxed{answer} without calling a tool."
)


@dataclass(kw_only=True, slots=True)
class MathPythonConfig:
    """Options of the math-with-Python environment (shared by all its episodes)."""

    tool_syntax: str = "qwen"
    """"qwen" (`<tool_call>` JSON), "fenced" (```python blocks) or "both"."""
    declare_tools: bool | None = None
    """Declare the python tool (`PYTHON_TOOL_SCHEMA`) to the chat template through
    `Environment.tools`: Qwen-style templates then add it, with the `<tool_call>` JSON format, to
    the system prompt. None: declare it unless `tool_syntax` is "fenced" (whose calls are not in
    that format); True with "fenced" is refused."""
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    """Inserted first when the sample's prompt has no system message; None inserts nothing."""
    max_tool_calls: int | None = None
    """Calls per episode before every further call is answered with an error; None: no cap."""
    max_calls_per_turn: int = 4
    timeout_s: float = 10.0
    memory_mb: int = 2048
    print_last_expression: bool = True
    """A trailing bare expression prints its value (notebook style)."""
    max_observation_chars: int = 8192
    reward: str = "math"
    """Reward name or "module:function" (see rewards.registry)."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    reward_timeout_s: float = 30.0
    reward_processes: int = 0
    """> 0: check answers in that many worker processes (hang-proof; see SafeReward)."""

    def __post_init__(self) -> None:
        if self.tool_syntax not in SYNTAXES:
            raise ValueError(f"MathPythonConfig.tool_syntax must be one of {SYNTAXES}, got {self.tool_syntax!r}")
        if self.max_calls_per_turn < 1 or self.timeout_s <= 0 or self.memory_mb <= 0:
            raise ValueError("MathPythonConfig: max_calls_per_turn, timeout_s and memory_mb must be positive")
        if self.declare_tools and self.tool_syntax == "fenced":
            raise ValueError('MathPythonConfig: declare_tools=True asks the model for <tool_call> JSON calls, '
                             'which tool_syntax="fenced" does not parse; use "both" or leave declare_tools unset')

    @property
    def tools_declared(self) -> bool:
        """`declare_tools` resolved (None -> whether the syntax is the template's `<tool_call>`)."""
        return self.declare_tools if self.declare_tools is not None else self.tool_syntax != "fenced"


class MathPythonEnv(Environment):
    """One TIR episode. Made by `MathPythonEnvFactory`, which owns the shared sandbox pool and
    reward wrapper (so their concurrency limits and failure counts span all episodes)."""

    def __init__(self, config: MathPythonConfig, pool: SandboxPool, reward: SafeReward) -> None:
        self.config = config
        self.pool = pool
        self.reward = reward
        self.sample: PromptSample | None = None
        self.messages: list[dict[str, str]] = []
        self.num_tool_calls = 0

    async def reset(self, sample: PromptSample) -> list[dict[str, str]]:
        self.sample = sample
        messages = [dict(m) for m in sample.messages]
        if self.config.system_prompt is not None and (not messages or messages[0]["role"] != "system"):
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        self.messages = messages
        return [dict(m) for m in messages]

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The python tool's schema for the chat template, unless `config.declare_tools` says no."""
        return [copy.deepcopy(PYTHON_TOOL_SCHEMA)] if self.config.tools_declared else None

    async def step(self, action_text: str) -> StepResult:
        assert self.sample is not None, "step() before reset()"
        self.messages.append({"role": "assistant", "content": action_text})
        parsed = parse_tool_calls(action_text, self.config.tool_syntax)
        if not parsed.has_tool_intent:
            return await self._final_answer(parsed.visible_text)
        parts = [f"Error: {error}" for error in parsed.errors]
        for i, call in enumerate(parsed.calls):
            if i >= self.config.max_calls_per_turn:
                parts.append(f"Error: at most {self.config.max_calls_per_turn} tool calls per turn; "
                             f"{len(parsed.calls) - i} not run")
                break
            parts.append(await self._run_call(call))
        observation = _truncate("\n\n".join(part.rstrip("\n") for part in parts), self.config.max_observation_chars)
        self.messages.append({"role": "tool", "content": observation})
        return StepResult(observation=observation, info={"num_tool_calls": self.num_tool_calls})

    async def _run_call(self, call: ToolCall) -> str:
        if call.name != "python":
            return f"Error: unknown tool {call.name!r}; the only tool is 'python'"
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return 'Error: the python tool needs a string argument "code"'
        cap = self.config.max_tool_calls
        if cap is not None and self.num_tool_calls >= cap:
            return f"Error: the tool-call limit ({cap}) is reached; give the final answer in \\boxed{{}}"
        self.num_tool_calls += 1
        if self.config.print_last_expression:
            code = print_last_expression(code)
        result = await self.pool.run(code, self.config.timeout_s, self.config.memory_mb)
        if result.ok:
            return result.output if result.output.strip() else "(no output)"
        return (result.output.rstrip() + "\n" if result.output.strip() else "") + f"Error: {result.error}"

    async def _final_answer(self, visible_text: str) -> StepResult:
        assert self.sample is not None
        outcome = await self.reward(RewardInput(sample=self.sample, response=visible_text,
                                                messages=[dict(m) for m in self.messages]))
        info: dict[str, Any] = {"num_tool_calls": self.num_tool_calls, "answer": extract_boxed(visible_text)}
        if not outcome.ok:
            info[REWARD_ERROR_KEY] = outcome.error
            return StepResult(observation="", reward=0.0, done=True, info=info)
        assert outcome.reward is not None
        return StepResult(observation="", reward=outcome.reward, done=True, info=info)


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [observation truncated: {len(text)} characters]"


class MathPythonEnvFactory:
    """`factory(sample) -> MathPythonEnv`: what the agent loop's `env_factory` expects."""

    def __init__(self, config: MathPythonConfig | None = None, *, pool: SandboxPool | None = None,
                 sandbox: SandboxConfig | None = None, max_concurrent_sandboxes: int | None = None) -> None:
        self.config = config or MathPythonConfig()
        self.pool = pool or SandboxPool(sandbox, max_concurrency=max_concurrent_sandboxes)
        self.reward = SafeReward(resolve_reward(self.config.reward, **self.config.reward_kwargs),
                                 name=self.config.reward, timeout_s=self.config.reward_timeout_s,
                                 processes=self.config.reward_processes)

    def __call__(self, sample: PromptSample) -> MathPythonEnv:
        return MathPythonEnv(self.config, self.pool, self.reward)

    def close(self) -> None:
        self.reward.close()
        self.pool.close()


def make_math_python(**kwargs: Any) -> MathPythonEnvFactory:
    """Registry builder: MathPythonConfig fields as keyword arguments, plus `sandbox` (a
    SandboxConfig or a dict of its fields) and `max_concurrent_sandboxes`."""
    sandbox = kwargs.pop("sandbox", None)
    if isinstance(sandbox, dict):
        sandbox = SandboxConfig(**sandbox)
    max_sandboxes = kwargs.pop("max_concurrent_sandboxes", None)
    try:
        config = MathPythonConfig(**kwargs)
    except TypeError as e:
        names = sorted(f.name for f in dataclasses.fields(MathPythonConfig))
        raise ValueError(f"math_python: {e}; valid options: {', '.join(names)}") from e
    return MathPythonEnvFactory(config, sandbox=sandbox, max_concurrent_sandboxes=max_sandboxes)
