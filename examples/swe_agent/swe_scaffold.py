"""A small SWE-style agent written against the `openai` client: the worked example of the gateway.

    python -m examples.swe_agent.swe_scaffold [--max-steps 30] [--command-timeout 10]

It does what OpenHands or mini-swe-agent do, in miniature: it writes the task's repository to
`./repo`, then loops: a chat completion with one `bash` tool (function calling); every call the
model makes runs in the rollout sandbox against `./repo` (`sandbox_repo.py`: no network, private
filesystem, limits; file changes come back) and its output goes back as the tool message. It stops
when the model answers without a tool call, after `--max-steps` model turns (the last turn's calls
still run: they may be the fix), or when the gateway refuses a request for a limit of the episode
(context or turns); then the verifier tests what is in `./repo`.

It knows nothing of training: the environment gives it `OPENAI_BASE_URL` / `OPENAI_API_KEY` (read
by the client), `OPENAI_MODEL`, `SAO_TASK_FILE` (the task: `messages`, `metadata.files`) and
`SAO_SANDBOX_EXEC`. Exit code 0 when the episode ran, whatever the tests say; an API error or a
task without a repository exits non-zero, and the environment fails the episode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import openai

from examples.swe_agent.sandbox_repo import run_command

BASH_TOOL = {"type": "function", "function": {
    "name": "bash",
    "description": "Run a bash command in the repository (the working directory); returns its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
# What the gateway answers (400) when the episode reached a limit: stop and let the verifier score.
LIMIT_CODES = ("context_length_exceeded", "max_turns_exceeded")


def write_repo(files: dict[str, str], root: Path) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def run_tool(call: Any, repo: Path, args: argparse.Namespace) -> str:
    """The tool message for one call: the command's output in the sandbox, or why it did not run."""
    if call.function.name != "bash":
        return f"error: unknown tool {call.function.name!r}; the only tool is bash"
    try:
        command = json.loads(call.function.arguments)["command"]
    except (ValueError, KeyError, TypeError):
        return 'error: the arguments must be a JSON object {"command": "..."}'
    if not isinstance(command, str):
        return "error: command must be a string"
    result = run_command(repo, command, timeout_s=args.command_timeout, max_output_chars=args.max_output_chars)
    return result.for_model()


def changed_files(files: dict[str, str], repo: Path) -> list[str]:
    now = {str(p.relative_to(repo)): p.read_text(errors="replace") for p in repo.rglob("*") if p.is_file()}
    return sorted(p for p in set(files) | set(now) if files.get(p) != now.get(p))


def _log(*parts: Any) -> None:
    print(*parts, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     description="A small SWE agent on the openai client, with a sandboxed bash tool.")
    parser.add_argument("--max-steps", type=int, default=30, help="model turns at most")
    parser.add_argument("--command-timeout", type=float, default=10.0, help="seconds per bash command")
    parser.add_argument("--max-output-chars", type=int, default=2000, help="tool output shown to the model")
    args = parser.parse_args(argv)
    task = json.loads(Path(os.environ["SAO_TASK_FILE"]).read_text())
    files = (task.get("metadata") or {}).get("files")
    if not files:
        _log("the task has no repository (metadata.files)")
        return 2
    repo = Path(os.environ.get("SAO_WORKDIR", ".")) / "repo"
    write_repo(files, repo)
    # No client retries: a retried request is the same conversation again, which the gateway
    # records as a new segment ("regenerated"); a failed call should fail the episode instead.
    client = openai.OpenAI(max_retries=0, timeout=600.0)
    model = os.environ.get("OPENAI_MODEL", "sao-policy")
    messages: list[Any] = list(task["messages"])
    for step in range(args.max_steps):
        try:
            reply = client.chat.completions.create(model=model, messages=messages, tools=[BASH_TOOL])
        except openai.BadRequestError as e:
            if e.code in LIMIT_CODES:
                _log(f"step {step}: stopped by the gateway: {e.code}")
                break
            raise
        choice = reply.choices[0]
        messages.append(choice.message)
        calls = choice.message.tool_calls or []
        _log(f"step {step}: finish_reason={choice.finish_reason} tool_calls={len(calls)}")
        if not calls:
            break
        for call in calls:
            output = run_tool(call, repo, args)
            _log(f"  $ {call.function.arguments[:200]!r}\n  -> {output[:300]!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    _log(f"changed files: {changed_files(files, repo)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
