"""A Slurm batch job from the package's template, and following it to its end.

`write_job_script(config, options, run_dir)` writes the job of a resolved config into a directory
of its own (`submission_dir`): the config and the script `render_script` makes, which fills
`sao_job.sbatch.in` (`fill_job_template`; package data next to this module: the job's flow, Ray
cluster, join barrier, driver, signals, requeue; its header comments say what each part does) with
the driver the job runs (`driver_command`) and, for a heterogeneous job, the engines' component
(`engine_component`). `check_container_paths` checks, before submission, what a containerised job
will look for; `job_state` / `wait_for_job` follow a submitted job through `scontrol` (no accounting
needed). What is checked before any of this (the command, the layout, the input files) is the
caller's: `jobs/launch.py` (`sao launch slurm`), with `jobs/preflight.py`.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from megatron_sao.config.schema import SaoConfig

REPO = Path(__file__).resolve().parents[2]
"""The repository the job runs from (its working directory, mounted into a container)."""
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




@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """What `sao launch slurm` chooses on its command line beyond the recipe's `launcher.*` fields."""

    driver_command: str = "train"
    """The `sao` sub-command the job runs (`--command`): a recipe command, or `convert ...`."""
    gpus_per_node: int | None = None
    """`--gpus-per-node`; None: `launcher.nproc_per_node` with SGLang engines, else no GPU request."""
    cpus_per_node: int = 1
    """CPUs each Ray node offers (`--cpus-per-node`)."""
    engine_partition: str | None = None
    """A heterogeneous job's engine partition (`--engine-partition`)."""
    engine_nodes: int | None = None
    """Its engine nodes (`--engine-nodes`; None: the planner's count)."""
    allow_loopback: bool = False
    """Let the job advertise a 127.x address (single-host tests)."""


def driver_command(command: str, python: str, config_path: Path, nodes: int, tasks_per_node: int) -> list[str]:
    """The driver the job runs on its first node: a recipe sub-command (`sao train|sft`,
    `value-pretrain train`, `config show`, ...) on the resolved config, whose launcher.kind=slurm
    makes `train`, `sft` and `value-pretrain train` start their ranks as srun tasks on every node
    (or Ray actors on the job's cluster with launcher.ray; `platform/launch.py`), or `convert ...`
    as it is given, one srun task per rank (`nodes x tasks_per_node`; the conversion adopts
    Slurm's task variables)."""
    words = shlex.split(command)
    if not words:
        raise ValueError("--command is empty: name a sao sub-command, e.g. train")
    if words[0] == "convert":
        return ["srun", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes * tasks_per_node}",
                f"--ntasks-per-node={tasks_per_node}", "--kill-on-bad-exit=1", python, "-m", "megatron_sao.cli",
                *words]
    return [python, "-m", "megatron_sao.cli", *words, str(config_path), "checkpoint.resume=auto"]


def engine_component(config: SaoConfig, options: JobOptions, gpus: int) -> tuple[int, list[str]]:
    """(engine nodes, #SBATCH lines of the job's second component) for a heterogeneous job with
    the rollout engines on `--engine-partition`; (0, []) otherwise. The engine nodes are the
    planner's (disaggregated SGLang engines), or `--engine-nodes` (e.g. CPU engines)."""
    if not options.engine_partition:
        if options.engine_nodes is not None:
            raise ValueError("--engine-nodes needs --engine-partition (the partition the engine nodes come from)")
        return 0, []
    from megatron_sao.config.placement import gpu_layout

    nodes = options.engine_nodes if options.engine_nodes is not None else gpu_layout(config).engine_nodes
    if nodes < 1 or nodes >= config.launcher.nnodes:
        raise ValueError(f"--engine-partition {options.engine_partition}: {nodes} engine nodes of launcher.nnodes="
                         f"{config.launcher.nnodes} leave no trainer or no engine node; engines need their own GPUs "
                         "(disaggregated placement: parallelism.world_size below the allocation) or --engine-nodes N")
    lines = ["#SBATCH hetjob", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --partition={options.engine_partition}"]
    lines += [f"#SBATCH --account={config.launcher.account}"] if config.launcher.account else []
    lines += [f"#SBATCH --gpus-per-node={gpus}"] if gpus else []
    return nodes, lines


def render_script(config: SaoConfig, options: JobOptions, run_dir: Path, config_path: Path) -> str:
    """The job script for `config` (resolved) with the command-line choices in `options`."""
    launcher = config.launcher
    gpus = options.gpus_per_node if options.gpus_per_node is not None else (
        launcher.nproc_per_node if config.rollout.engine == "sglang" else 0)
    engine_nodes, engine_lines = engine_component(config, options, gpus)
    lines = [f"#SBATCH --time={launcher.time_limit}"]
    lines += [f"#SBATCH --partition={launcher.partition}"] if launcher.partition else []
    lines += [f"#SBATCH --account={launcher.account}"] if launcher.account else []
    lines += [f"#SBATCH --gpus-per-node={gpus}"] if gpus else []
    lines.append("#SBATCH --requeue" if launcher.requeue else "#SBATCH --no-requeue")
    lines += [f"#SBATCH {line}" for line in launcher.extra_sbatch]
    lines += engine_lines
    srun_extra: list[str] = []
    python = sys.executable
    paths = {"run directory": run_dir, "working directory": REPO, "resolved config": config_path}
    for key in ("model.hf_path", "data.trajectories_path"):
        section, name = key.split(".")
        if value := getattr(getattr(config, section), name):
            paths[key] = Path(value)
    if launcher.container_image:
        extra = [m.split(":")[1] if ":" in m else m for m in launcher.container_mounts]
        mounts = sorted({REPO, run_dir, *(p.parent for k, p in paths.items() if "." in k)}, key=str)
        check_container_paths(paths, [*mounts, *map(Path, extra)], launcher.container_image)
        spec = [f"{m}:{m}" for m in mounts] + list(launcher.container_mounts)
        srun_extra = [f"--container-image={launcher.container_image}", "--container-mounts=" + ",".join(spec),
                      f"--container-workdir={REPO}"]
        python = "python"
    driver = driver_command(options.driver_command, python, config_path, launcher.nnodes - engine_nodes,
                            launcher.nproc_per_node)
    if launcher.container_image:  # the batch shell runs on the host: the driver needs its own step
        driver = ["srun", *srun_extra, "--overlap", "--nodes=1", "--ntasks=1", "-w", "$HEAD", *driver]
    fields = {
        "JOB_NAME": f"sao-{config.run.name}", "NODES": str(launcher.nnodes - engine_nodes),
        "HET": "1" if engine_nodes else "0", "RUN_DIR": shlex.quote(str(run_dir)),
        "TASKS_PER_NODE": str(launcher.nproc_per_node),
        "SBATCH_LINES": "\n".join(lines), "REQUEUE": "1" if launcher.requeue else "0", "GPUS_PER_NODE": str(gpus),
        "CPUS_PER_NODE": str(options.cpus_per_node), "NET_IFACE": shlex.quote(launcher.network_interface),
        "PORT_RANGE": shlex.quote(launcher.port_range), "JOIN_TIMEOUT": str(launcher.join_timeout_s),
        "ALLOW_LOOPBACK": "1" if options.allow_loopback else "0", "PYTHON": shlex.quote(python),
        "SRUN_EXTRA": " ".join(shlex.quote(s) for s in srun_extra), "WORKDIR": shlex.quote(str(REPO)),
        "DRIVER": " ".join('"$HEAD"' if s == "$HEAD" else shlex.quote(s) for s in driver),
    }
    return fill_job_template(fields)


def submission_dir(run_dir: Path, dry_run: bool) -> Path:
    """Where one launch writes its config and script: `<run dir>/launch/dry-run/` (replaced by the next
    dry run; no job reads it), else a new `<run dir>/launch/submit-<time>-<id>/` that only the job
    submitted from it reads, at its start and after every requeue."""
    launch_dir = run_dir / "launch"
    if dry_run:
        return launch_dir / "dry-run"
    return launch_dir / f"submit-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def write_job_script(config: SaoConfig, options: JobOptions, run_dir: Path, dry_run: bool) -> Path:
    """Write config + script of a checked launch into their own directory (`submission_dir`); the
    script, checked by `bash -n`. A script that fails its checks leaves no new directory behind."""
    from megatron_sao.config import dump_config

    out_dir = submission_dir(run_dir, dry_run)
    if dry_run:
        shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    try:
        config_path = dump_config(config, out_dir / "config.yaml")
        text = render_script(config, options, run_dir, config_path)
        check = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        if check.returncode:
            raise AssertionError(f"generated script does not parse: {check.stderr.strip()}")
        script = out_dir / "sao_job.sbatch"
        script.write_text(text)
        script.chmod(0o755)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return script
