"""One shell command in the rollout sandbox, against a copy of a directory whose changes come back.

The sandbox (`rollout/sandbox/`, reached through `$SAO_SANDBOX_EXEC`: Python on stdin, output on
stdout) keeps nothing between calls and sees only a private /tmp. So each call ships the directory
in (a gzipped tar, base64, inside the Python program), unpacks it in /tmp/repo, runs
`bash -c COMMAND` there (its own wall-clock limit, output capped), packs /tmp/repo again and prints
it after a marker line; the caller replaces its directory with that. A call that dies (sandbox
timeout, output limit) or a directory grown past `max_archive_bytes` changes nothing on the host.

Standard library only: the scaffold and the verifier both use it, and neither should need more
than the `openai` client.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "@@sao-repo-result@@ "
_SKIP = ("__pycache__", ".pytest_cache")

# Runs inside the sandbox: `SPEC` (a JSON object) is appended before it is sent.
_PROGRAM = r'''
import base64, io, json, os, signal, subprocess, sys, tarfile
SPEC = json.loads(SPEC_JSON)
REPO = "/tmp/repo"
os.makedirs(REPO)
with tarfile.open(fileobj=io.BytesIO(base64.b64decode(SPEC["archive"])), mode="r:gz") as tar:
    tar.extractall(REPO, filter="data")
env = dict(os.environ, PATH=os.path.dirname(sys.executable) + ":" + os.environ.get("PATH", ""),
           PYTHONDONTWRITEBYTECODE="1")
status = {"exit_code": None, "timed_out": False}
try:
    proc = subprocess.Popen(["bash", "-c", SPEC["command"]], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=SPEC["timeout_s"])
        status["exit_code"] = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # background jobs too, so the pipe closes
        out, _ = proc.communicate()
        status["timed_out"] = True
    text = out.decode("utf-8", errors="replace")
except (OSError, ValueError) as e:  # e.g. a NUL byte in the command
    text = f"cannot run the command: {e}"
limit = SPEC["max_output_chars"]
if len(text) > limit:
    text = text[:limit] + f"\n[output truncated: {len(text)} characters]"
sys.stdout.write(text)
if SPEC["return_files"]:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(REPO, arcname=".", filter=lambda info: None if info.name.rsplit("/", 1)[-1] in SPEC["skip"] else info)
    data = base64.b64encode(buffer.getvalue()).decode()
    status["archive"] = data if len(data) <= SPEC["max_archive_bytes"] else None
    status["archive_bytes"] = len(data)
sys.stdout.write("\n" + SPEC["marker"] + json.dumps(status) + "\n")
'''


@dataclass(slots=True)
class CommandResult:
    output: str
    """What the command printed (stdout and stderr merged, capped), or why it could not run."""
    exit_code: int | None = None
    timed_out: bool = False
    files_kept: bool | None = None
    """The directory now holds what the command left (False: unchanged; None: not asked for)."""
    error: str | None = None
    """Why the sandbox call itself failed (the command's own failures are in exit_code)."""

    def for_model(self) -> str:
        """The tool message: the output, then how the command ended."""
        if self.error:
            return f"{self.output}\n[error: {self.error}]".strip()
        ending = ("timed out" if self.timed_out else "not run" if self.exit_code is None
                  else f"exit status {self.exit_code}")
        kept = "; file changes were not kept" if self.files_kept is False else ""
        return f"{self.output}\n[{ending}{kept}]".strip()


def default_sandbox_exec() -> str:
    """`$SAO_SANDBOX_EXEC` (set by the `openai_scaffold` environment), else the same helper here."""
    return os.environ.get("SAO_SANDBOX_EXEC") or shlex.join(
        [sys.executable, "-m", "megatron_sao.rollout.gateway.sandbox_exec"])


def pack(root: Path) -> str:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(root, arcname=".", filter=lambda info: None if Path(info.name).name in _SKIP else info)
    return base64.b64encode(buffer.getvalue()).decode()


def unpack(data: str, root: Path) -> None:
    """Replace `root`'s contents with the archive (unpacked aside first, so a bad one changes nothing)."""
    staging = root.with_name(root.name + ".incoming")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(data)), mode="r:gz") as tar:
        tar.extractall(staging, filter="data")  # no absolute paths, links out, or devices
    shutil.rmtree(root, ignore_errors=True)
    staging.rename(root)


def run_command(repo: Path, command: str, *, sandbox_exec: str | None = None, timeout_s: float = 10.0,
                max_output_chars: int = 2000, return_files: bool = True,
                max_archive_bytes: int = 12_000) -> CommandResult:
    """Run `command` with a copy of `repo` as its working directory in a fresh sandbox; with
    `return_files`, `repo` then holds what the command left there. `timeout_s` bounds the command;
    the sandbox's own limit (`--timeout` of the helper) bounds the whole call. The sandbox caps its
    output at 16 KiB: `max_output_chars` plus the archive must fit."""
    spec = {"archive": pack(repo), "command": command, "timeout_s": timeout_s, "max_output_chars": max_output_chars,
            "return_files": return_files, "max_archive_bytes": max_archive_bytes, "marker": MARKER,
            "skip": list(_SKIP)}
    program = f"SPEC_JSON = {json.dumps(json.dumps(spec))}\n{_PROGRAM}"
    try:
        proc = subprocess.run(sandbox_exec or default_sandbox_exec(), shell=True, input=program, capture_output=True,
                              text=True, errors="replace", timeout=timeout_s + 120)
    except subprocess.TimeoutExpired:
        return CommandResult(output="", error="the sandbox did not answer")
    head, found, tail = proc.stdout.rpartition("\n" + MARKER)
    if not found:
        why = f"the sandbox call failed (exit code {proc.returncode}) {proc.stderr.strip()[-300:]}"
        return CommandResult(output=proc.stdout.strip()[-max_output_chars:], error=why.strip())
    status = json.loads(tail.splitlines()[0])
    result = CommandResult(output=head, exit_code=status["exit_code"], timed_out=status["timed_out"])
    if return_files and status.get("archive"):
        unpack(status["archive"], repo)
        result.files_kept = True
    elif return_files:
        result.files_kept = False
        result.error = f"the directory grew to {status.get('archive_bytes')} bytes packed, over {max_archive_bytes}"
    return result
