"""A Slurm batch job from the package's template, and following it to its end.

`fill_job_template(fields)` fills `sao_job.sbatch.in` (package data next to this module: the job's
flow, Ray cluster, join barrier, driver, signals, requeue; its header comments say what each part
does); `check_container_paths` checks, before submission, what a containerised job will look for;
`job_state` / `wait_for_job` follow a submitted job through `scontrol` (no accounting needed).
What goes into the fields (the recipe's driver command, the engine component of a heterogeneous
job) is the caller's: `jobs/launch.py` (`sao launch slurm`).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

TEMPLATE = Path(__file__).with_name("sao_job.sbatch.in")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                   "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "PURGED"}


def fill_job_template(fields: dict[str, str]) -> str:
    """The job script: every `{{NAME}}` of the template replaced by `fields[NAME]`; AssertionError
    naming any field left unfilled."""
    text = TEMPLATE.read_text()
    for key, value in fields.items():
        text = text.replace("{{" + key + "}}", value)
    if leftover := re.findall(r"\{\{[A-Z_]+\}\}", text):
        raise AssertionError(f"template fields left unfilled: {leftover}")
    return text


def check_container_paths(paths: dict[str, Path], mounts: list[Path], image: str) -> None:
    """Before submission: every path the job uses exists here and is under a container mount,
    and an image given as a file (.sqsh) exists. ValueError naming the path otherwise."""
    if (image.startswith(("/", "./", "../")) or image.endswith(".sqsh")) and not Path(image).exists():
        raise ValueError(f"--container {image}: no such image file")
    for name, path in paths.items():
        if not path.exists():
            raise ValueError(f"{name} = {path} does not exist on the submission host")
        if not any(path.resolve().is_relative_to(m.resolve()) for m in mounts):
            raise ValueError(f"{name} = {path} is not under any container mount "
                             f"({', '.join(str(m) for m in mounts)})")


def job_state(job_id: str) -> tuple[str, int]:
    """(JobState, exit status) from `scontrol show job` (no accounting needed). A controller that
    does not answer is UNKNOWN (polled again); a job it no longer knows is PURGED (final)."""
    proc = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    if proc.returncode:
        return ("PURGED" if "Invalid job id" in proc.stderr else "UNKNOWN"), 1
    out = proc.stdout
    state = re.search(r"JobState=(\S+)", out)
    code = re.search(r"\bExitCode=(\d+):(\d+)", out)
    status = int(code[1]) or (128 + int(code[2]) if int(code[2]) else 0) if code else 1
    return (state[1] if state else "UNKNOWN"), status


def wait_for_job(job_id: str, run_dir: Path, poll_s: float = 3.0) -> int:
    """Follow job `job_id` until it ends; its exit status (the output's tail on failure)."""
    state, status = "PENDING", 0
    while state not in TERMINAL_STATES:
        time.sleep(poll_s)
        state, status = job_state(job_id)
    status = status or (0 if state == "COMPLETED" else 1)
    print(f"job {job_id} ended: {state}, exit {status}", flush=True)
    log = run_dir / f"slurm-{job_id}.out"
    if status and log.is_file():
        print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:]), end="", file=sys.stderr)
    return status


