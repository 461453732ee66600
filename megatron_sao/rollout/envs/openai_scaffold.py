"""`openai_scaffold`: an unmodified agent scaffold, driving the model through the agent gateway.

Per episode: a fresh work directory holding `task.json` (the prompt sample: `prompt_id`,
`messages`, `answer`, `metadata`); the scaffold `command` started there (optionally inside
`container_command`, e.g. `docker run --rm --network host -v {workdir}:/work IMAGE`) with its
session's gateway URL in `OPENAI_BASE_URL`, waited for (`timeout_s`), then `verifier_command` run
in the same directory for the reward. The scaffold's own tools run where the scaffold runs: in
the container, or - for Python snippets - in the rollout sandbox through the helper named by
`SAO_SANDBOX_EXEC` (`python -m megatron_sao.rollout.gateway.sandbox_exec`: code on stdin, the
output on stdout; no network, read-only filesystem, limits of `rollout/sandbox/`).

Environment variables the scaffold gets (on top of ours, or of `env` when given, and `extra_env`): OPENAI_BASE_URL,
OPENAI_API_BASE (older clients), OPENAI_API_KEY, OPENAI_MODEL, SAO_TASK_FILE, SAO_WORKDIR,
SAO_PROMPT_ID, SAO_SANDBOX_EXEC; the verifier gets the same, with the scaffold's exit code in
SAO_SCAFFOLD_EXIT_CODE.

Reward: the verifier's last stdout line when it is a number, else 1.0 for exit code 0 and 0.0
otherwise. A scaffold that exits non-zero, is killed, or outlives `timeout_s` fails the episode
(FAILED with the reason and the tail of its log); so does a verifier that cannot run or times out.

A scaffold drives the model itself, so this environment is not stepped by `AgentLoop`: the
gateway's `ScaffoldRunner` runs it (`run_episode`). `reset` / `step` refuse, so an agent loop given
this environment fails each trajectory with a message saying so rather than silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_sao.rollout.environment import Environment, PromptSample, StepResult
from megatron_sao.utils.lifetime import keeper_command

_LOG_TAIL_CHARS = 600


@dataclass(kw_only=True, slots=True)
class OpenAIScaffoldConfig:
    command: tuple[str, ...]
    """The scaffold's argv, run once per episode in its work directory."""
    verifier_command: tuple[str, ...] | None = None
    """Run after the scaffold exits 0; None: reward 1.0 for a clean exit."""
    timeout_s: float = 3600.0
    """Wall clock of one scaffold run; beyond it the process group is killed -> FAILED."""
    verifier_timeout_s: float = 600.0
    container_command: tuple[str, ...] = ()
    """Prefix of the scaffold's argv (a container runtime); `{workdir}` in it is substituted."""
    env: dict[str, str] | None = None
    """Base environment of the scaffold; None inherits ours."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Added to the base environment (a scaffold's own switches, e.g. MSWEA_COST_TRACKING)."""
    api_key: str = "sao-gateway"
    max_concurrent: int = 32
    """Scaffolds running at once (episodes beyond it wait before starting theirs)."""
    workdir_root: str | None = None
    keep_workdir: bool = False
    sandbox_timeout_s: float = 30.0
    sandbox_memory_mb: int = 1024

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("openai_scaffold: environment_kwargs.command is empty")
        for name in ("timeout_s", "verifier_timeout_s", "sandbox_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"openai_scaffold: {name} must be > 0, got {getattr(self, name)}")
        if self.max_concurrent < 1:
            raise ValueError(f"openai_scaffold: max_concurrent must be >= 1, got {self.max_concurrent}")


@dataclass(slots=True)
class ScaffoldOutcome:
    reward: float | None = None
    failure: str | None = None
    """Why the episode failed (crash, timeout, verifier), None when it ran through."""
    exit_code: int | None = None
    scaffold_s: float = 0.0
    verifier_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


class _Slots:
    """The concurrency bound shared by every episode of one factory (made on first use, in the loop)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.semaphore: asyncio.Semaphore | None = None

    def get(self) -> asyncio.Semaphore:
        if self.semaphore is None:
            self.semaphore = asyncio.Semaphore(self.n)
        return self.semaphore


class OpenAIScaffoldEnvironment(Environment):
    driven_by_gateway = True

    def __init__(self, config: OpenAIScaffoldConfig, slots: _Slots | None = None) -> None:
        self.config = config
        self._slots = slots or _Slots(config.max_concurrent)

    async def reset(self, sample: PromptSample) -> list[dict[str, str]]:
        raise TypeError("openai_scaffold episodes drive the model themselves: run them with "
                        "megatron_sao.rollout.gateway.ScaffoldRunner, not AgentLoop")

    async def step(self, action_text: str) -> StepResult:
        raise TypeError("openai_scaffold episodes are not stepped (see reset)")

    async def run_episode(self, sample: PromptSample, base_url: str, model: str) -> ScaffoldOutcome:
        """Run the scaffold against `base_url`, then the verifier. Never raises for what the scaffold
        or verifier do; cancelling it kills the scaffold's process group."""
        c = self.config
        workdir = Path(tempfile.mkdtemp(prefix="sao_scaffold_", dir=c.workdir_root))
        task = {"prompt_id": sample.prompt_id, "messages": sample.messages, "answer": sample.answer,
                "metadata": sample.metadata}
        (workdir / "task.json").write_text(json.dumps(task))
        env = {**(os.environ if c.env is None else c.env), **c.extra_env}
        env.update(OPENAI_BASE_URL=base_url, OPENAI_API_BASE=base_url, OPENAI_API_KEY=c.api_key, OPENAI_MODEL=model,
                   SAO_TASK_FILE=str(workdir / "task.json"), SAO_WORKDIR=str(workdir), SAO_PROMPT_ID=sample.prompt_id,
                   SAO_SANDBOX_EXEC=shlex.join([sys.executable, "-m", "megatron_sao.rollout.gateway.sandbox_exec",
                                                "--timeout", str(c.sandbox_timeout_s),
                                                "--memory-mb", str(c.sandbox_memory_mb)]))
        outcome = ScaffoldOutcome()
        try:
            async with self._slots.get():
                argv = [a.replace("{workdir}", str(workdir)) for a in c.container_command] + list(c.command)
                start = time.perf_counter()
                code, timed_out = await _run(argv, workdir, env, c.timeout_s, workdir / "scaffold.log")
                outcome.scaffold_s, outcome.exit_code = time.perf_counter() - start, code
            if timed_out:
                outcome.failure = f"scaffold_timeout: > {c.timeout_s:g} s; log: {_tail(workdir / 'scaffold.log')}"
            elif code != 0:
                outcome.failure = f"scaffold_crashed: exit code {code}; log: {_tail(workdir / 'scaffold.log')}"
            else:
                await self._verify(workdir, {**env, "SAO_SCAFFOLD_EXIT_CODE": str(code)}, outcome)
        except OSError as e:
            outcome.failure = f"scaffold_start_error: {e}"
        finally:
            if not c.keep_workdir:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                outcome.info["workdir"] = str(workdir)
        return outcome

    async def _verify(self, workdir: Path, env: dict[str, str], outcome: ScaffoldOutcome) -> None:
        c = self.config
        if c.verifier_command is None:
            outcome.reward = 1.0
            return
        start = time.perf_counter()
        code, timed_out = await _run(list(c.verifier_command), workdir, env, c.verifier_timeout_s,
                                     workdir / "verifier.log")
        outcome.verifier_s = time.perf_counter() - start
        log = (workdir / "verifier.log").read_text(errors="replace")
        if timed_out:
            outcome.failure = f"verifier_timeout: > {c.verifier_timeout_s:g} s"
            return
        lines = log.strip().splitlines()
        try:
            outcome.reward = float(lines[-1].strip()) if lines else None
        except ValueError:
            outcome.reward = None
        if outcome.reward is None:
            outcome.reward = 1.0 if code == 0 else 0.0
        outcome.info["verifier_exit_code"] = code


async def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float, log: Path) -> tuple[int, bool]:
    """(exit code, timed out) of `argv`, output to `log`; its whole process group dies with it, and
    with this process (a keeper, utils/lifetime.py)."""
    program = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if program is None or not os.access(cwd / program, os.X_OK):  # as exec would say, not the keeper's 127
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(*keeper_command(argv), cwd=cwd, env=env,
                                                    stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=out, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True)
    try:
        return await asyncio.wait_for(proc.wait(), timeout_s), False
    except TimeoutError:
        return -1, True
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # tools the scaffold left behind go too
        if proc.returncode is None:
            await proc.wait()


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-_LOG_TAIL_CHARS:].strip().replace("\n", " | ")


def make_openai_scaffold(command: str | list[str], verifier_command: str | list[str] | None = None,
                         container_command: str | list[str] | None = None, gateway_host: str = "127.0.0.1",
                         gateway_port: int = 0, tool_call_format: str = "auto", model_name: str = "sao-policy",
                         **kwargs: Any) -> Any:
    """Registry builder: commands as lists or shell-like strings, `OpenAIScaffoldConfig` fields, and
    the gateway's options (`GatewayConfig` host / port / tool_call_format / model_name), which the
    runner reads from the factory's `gateway_options`. `{python}` in a command is this process's
    interpreter: a recipe cannot know where the run's virtual environment is, and `python` on the
    PATH need not be it (`.venv/bin/sao train` does not put `.venv/bin` on the PATH)."""

    def argv(value: str | list[str] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        parts = shlex.split(value) if isinstance(value, str) else value
        return tuple(str(part).replace("{python}", sys.executable) for part in parts)

    config = OpenAIScaffoldConfig(command=argv(command) or (), verifier_command=argv(verifier_command),
                                  container_command=argv(container_command) or (), **kwargs)
    slots = _Slots(config.max_concurrent)
    factory = lambda sample: OpenAIScaffoldEnvironment(config, slots)  # noqa: E731
    factory.driven_by_gateway = True  # type: ignore[attr-defined]
    factory.gateway_options = {"host": gateway_host, "port": gateway_port,  # type: ignore[attr-defined]
                               "tool_call_format": tool_call_format, "model_name": model_name}
    return factory
