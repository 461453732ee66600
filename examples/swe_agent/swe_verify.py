"""The worked example's verifier: the task's unit tests, run in the sandbox, give the reward.

    python -m examples.swe_agent.swe_verify    # in the episode's work directory

In a copy of `./repo` it puts the task's test files back as they were (editing the tests earns
nothing), runs `python -m unittest -v <the test modules>` there in the rollout sandbox (the code is
the model's: it never runs on the host), and prints the test output, then the reward as the last
line, which the `openai_scaffold` environment reads: 1.0 when the run exits 0 and every test the
task's files define reports `ok` (a test module that exits early, or a test that vanished, does
not count as passing), else 0.0. A sandbox that cannot run at all exits 1 without a number
(the environment then scores 0.0).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from examples.swe_agent.sandbox_repo import run_command


def expected_tests(task: dict[str, Any]) -> list[str]:
    """`test_name (module.Class.test_name)` heads of unittest's verbose lines, one per test."""
    meta = task["metadata"]
    found = []
    for path in meta["test_files"]:
        module = path.removesuffix(".py").replace("/", ".")
        current = None
        for line in meta["files"][path].splitlines():
            if m := re.match(r"class (\w+)\(", line):
                current = m.group(1)
            elif (m := re.match(r"    def (test\w*)\(", line)) and current:
                found.append(f"{m.group(1)} ({module}.{current}.{m.group(1)})")
    return found


def verify(task: dict[str, Any], repo: Path, *, sandbox_exec: str | None = None,
           timeout_s: float = 60.0) -> tuple[float | None, str]:
    """(reward, test output) for what `repo` holds; reward None when the sandbox could not run."""
    meta = task["metadata"]
    modules = [p.removesuffix(".py").replace("/", ".") for p in meta["test_files"] if not p.endswith("__init__.py")]
    with tempfile.TemporaryDirectory(prefix="sao_verify_") as tmp:
        copy = Path(tmp) / "repo"
        if repo.is_dir():
            shutil.copytree(repo, copy, symlinks=True)
        for path in meta["test_files"]:
            target = copy / path
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.is_symlink() or target.exists():  # the repository's links all stay inside it
                target.unlink()                              # (archives are unpacked with tarfile's data filter)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(meta["files"][path])
        result = run_command(copy, f"python -m unittest -v {' '.join(modules)}", sandbox_exec=sandbox_exec,
                             timeout_s=timeout_s, max_output_chars=8000, return_files=False)
    if result.error:
        return None, result.for_model()
    ok_lines = {line.rsplit(" ... ", 1)[0] for line in result.output.splitlines() if line.endswith(" ... ok")}
    passed = result.exit_code == 0 and all(test in ok_lines for test in expected_tests(task))
    return (1.0 if passed else 0.0), result.for_model()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     description="Run the task's tests on ./repo in the sandbox; print the reward.")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the test run")
    args = parser.parse_args(argv)
    workdir = Path(os.environ.get("SAO_WORKDIR", "."))
    task = json.loads(Path(os.environ.get("SAO_TASK_FILE", workdir / "task.json")).read_text())
    reward, output = verify(task, workdir / "repo", timeout_s=args.timeout)
    print(output, flush=True)
    if reward is None:
        return 1
    print(reward)
    return 0


if __name__ == "__main__":
    sys.exit(main())
