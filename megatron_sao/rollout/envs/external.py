"""Adapter point for external agent scaffolds (SWE harnesses such as OpenHands, game servers).

An external environment is any program that speaks this line protocol on stdin / stdout, one
JSON object per line, one reply per request, for one episode per process:

    -> {"op": "reset", "sample": {"prompt_id", "messages", "answer", "metadata"}}
    <- {"ok": true, "messages": [...], "tools": [...]}       ("messages", "tools" optional)
    -> {"op": "step", "action": "<assistant turn text>"}
    <- {"observation": str, "reward": number, "done": bool, "truncated": bool,
        "role": "tool" | "user", "info": {}}                 (all but "observation" optional)
    -> {"op": "close"}
    <- {"ok": true}                       (then exit; the adapter kills it after a grace period)

The reset reply may replace the dataset prompt with its own `messages` (`{"role", "content"}`
strings; a scaffold that builds the task from a repository checkout) and declare `tools`
(OpenAI-style JSON schemas, `Environment.tools`); without them the prompt is the sample's and no
tools are declared. `"truncated": true` (with `"done": true`) ends the episode by the program's
own limit, its reason under `info["truncation_reason"]` (`StepResult.truncated`).

Any request may instead be answered `{"error": "<reason>"}`. A reply that is late, not JSON, of
the wrong shape, or a process that dies is an environment failure: `reset` or `step` raises
`ExternalEnvError`, which the agent loop records as a FAILED trajectory (nothing else stops).
The program's stderr is inherited (its logs land in ours).

The process is started in `reset` (awaited: the event loop goes on with other episodes while it
starts and prepares the task), so a program that cannot start fails the trajectory before any
token is generated; a failed `reset` closes the process itself. Wrapping OpenHands would mean a
small server that starts its runtime (container) on `reset` and maps `step` to "execute this
agent action, return the observation": this module is the interface, `guess_number.py` a worked
example that runs here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import numbers
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from megatron_sao.rollout.environment import Environment, PromptSample, StepResult

_CLOSE_GRACE_S = 2.0


class ExternalEnvError(RuntimeError):
    """The external environment broke the protocol, timed out or died."""


@dataclass(kw_only=True, slots=True)
class SubprocessEnvConfig:
    command: tuple[str, ...]
    """Program and arguments, started once per episode."""
    reply_timeout_s: float = 60.0
    """Longest wait for any one reply (reset, step or close); the reset reply includes the
    program's own preparation (a container start), so size it for that."""
    max_line_bytes: int = 16 * 1024 * 1024
    env: dict[str, str] | None = None
    """Environment of the process; None inherits ours."""
    cwd: str | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("SubprocessEnvConfig.command is empty")
        if self.reply_timeout_s <= 0:
            raise ValueError(f"SubprocessEnvConfig.reply_timeout_s must be > 0, got {self.reply_timeout_s}")


class SubprocessEnvironment(Environment):
    """One episode of an external environment process."""

    def __init__(self, config: SubprocessEnvConfig) -> None:
        self.config = config
        self._proc: asyncio.subprocess.Process | None = None
        self._tools: list[dict[str, Any]] | None = None

    async def reset(self, sample: PromptSample) -> list[dict[str, str]]:
        """Start the process and send it the sample; the prompt is the reply's `messages`, else
        the sample's. Raises `ExternalEnvError` (after closing the process) if that fails."""
        assert self._proc is None, "reset() twice: one SubprocessEnvironment is one episode"
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.config.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                env=self.config.env, cwd=self.config.cwd, limit=self.config.max_line_bytes,
            )
        except OSError as e:
            raise ExternalEnvError(f"cannot start {shlex.join(self.config.command)}: {e}") from e
        request = {"prompt_id": sample.prompt_id, "messages": sample.messages, "answer": sample.answer,
                   "metadata": sample.metadata}
        try:
            reply = await self._request({"op": "reset", "sample": request})
            if reply.get("ok") is not True:
                raise ExternalEnvError(f"reset was not acknowledged: {str(reply)[:200]}")
            messages = _reset_messages(reply, sample)
            self._tools = _reset_tools(reply)
        except Exception:
            await self.close()  # no process outlives a failed reset, whoever forgets close()
            raise
        return messages

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The tools the program declared in its reset reply (None if it declared none)."""
        return self._tools

    async def step(self, action_text: str) -> StepResult:
        assert self._proc is not None, "step() before reset() or after close()"
        return _step_result(await self._request({"op": "step", "action": action_text}))

    async def _request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        timeout_s = timeout_s or self.config.reply_timeout_s
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write((json.dumps(message) + "\n").encode())
            await proc.stdin.drain()
            line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        except TimeoutError as e:
            raise ExternalEnvError(f"no reply to {message['op']!r} within {timeout_s:g} s") from e
        except (ConnectionError, ValueError) as e:  # broken pipe; a line over max_line_bytes
            raise ExternalEnvError(f"{message['op']!r} failed: {type(e).__name__}: {e}") from e
        if not line:
            code = await proc.wait()
            raise ExternalEnvError(f"the environment process exited (code {code}) before answering {message['op']!r}")
        try:
            reply = json.loads(line)
        except ValueError as e:
            raise ExternalEnvError(f"reply to {message['op']!r} is not JSON: {line[:200]!r}") from e
        if not isinstance(reply, dict):
            raise ExternalEnvError(f"reply to {message['op']!r} is not an object: {line[:200]!r}")
        if "error" in reply:
            raise ExternalEnvError(f"the environment reported an error on {message['op']!r}: {reply['error']}")
        return reply

    async def close(self) -> None:
        """Ask the process to finish, then make sure it has: close its stdin, kill it after a
        grace period (at most ~4 s in all, whatever the process does)."""
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.returncode is None:
                with contextlib.suppress(ExternalEnvError):
                    await self._request({"op": "close"}, timeout_s=min(self.config.reply_timeout_s, _CLOSE_GRACE_S))
                if proc.stdin is not None:
                    proc.stdin.close()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), _CLOSE_GRACE_S)
        finally:
            self._proc = None
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def _reset_messages(reply: dict[str, Any], sample: PromptSample) -> list[dict[str, str]]:
    messages = reply.get("messages")
    if messages is None:
        return [dict(m) for m in sample.messages]
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ExternalEnvError(f"reset reply: messages must be a non-empty list of {{role, content}} strings: "
                               f"{str(messages)[:200]}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _reset_tools(reply: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = reply.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ExternalEnvError(f"reset reply: tools must be a list of JSON schemas (objects): {str(tools)[:200]}")
    return tools


def _step_result(reply: dict[str, Any]) -> StepResult:
    observation, reward = reply.get("observation", ""), reply.get("reward", 0.0)
    done, role, info = reply.get("done", False), reply.get("role", "tool"), reply.get("info", {})
    truncated = reply.get("truncated", False)
    if not isinstance(observation, str) or not isinstance(done, bool) or role not in ("tool", "user"):
        raise ExternalEnvError(f"step reply has the wrong shape: {str(reply)[:200]}")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not isinstance(info, dict):
        raise ExternalEnvError(f"step reply has the wrong shape: {str(reply)[:200]}")
    if not isinstance(truncated, bool) or (truncated and not done):
        raise ExternalEnvError(f"step reply has the wrong shape (truncated needs done): {str(reply)[:200]}")
    return StepResult(observation=observation, reward=float(reward), done=done, truncated=truncated, role=role,
                      info=info)


def make_subprocess_env(command: str | list[str] | tuple[str, ...], **kwargs: Any) -> Any:
    """Registry builder: `command` (a list, or a string split like a shell would) plus the other
    SubprocessEnvConfig fields."""
    argv = tuple(shlex.split(command)) if isinstance(command, str) else tuple(command)
    config = SubprocessEnvConfig(command=argv, **kwargs)
    return lambda sample: SubprocessEnvironment(config)


def make_guess_number(**kwargs: Any) -> Any:
    """Registry builder for the worked example (`envs/guess_number.py`) run with our interpreter."""
    return make_subprocess_env([sys.executable, "-m", "megatron_sao.rollout.envs.guess_number"], **kwargs)
