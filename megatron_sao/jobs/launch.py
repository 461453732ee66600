"""`sao launch slurm|local RECIPE [overrides] [flags]`: run a recipe's driver on a cluster.

slurm: fills launchers/slurm/sao_job.sbatch.in for the recipe, writes it into the run directory
(`sbatch script: PATH`), checks it (`bash -n`, container paths), submits it with sbatch unless
`--dry-run`, and with `--wait` follows the job and exits with its exit code. The job forms a Ray
cluster over its nodes, runs the driver (`sao train` on the resolved config with
`checkpoint.resume=auto`, its ranks as srun tasks on every node; or another `sao` sub-command via
`--command`) and propagates its exit code; see the template for signals, requeue and node failure.
`--engine-partition` makes it a heterogeneous job with the rollout engines on another partition.

local: the same flow on this machine without Slurm (launchers/local/run.sh).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "launchers" / "slurm" / "sao_job.sbatch.in"
LOCAL_SCRIPT = REPO / "launchers" / "local" / "run.sh"
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                   "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "PURGED"}
_FLAG_FIELDS = {"nodes": "launcher.nnodes", "gpus_per_node": "launcher.nproc_per_node",
                "partition": "launcher.partition", "account": "launcher.account", "time": "launcher.time_limit",
                "container": "launcher.container_image", "interface": "launcher.network_interface",
                "port_range": "launcher.port_range", "join_timeout": "launcher.join_timeout_s"}
TRAINER_COMMANDS = {"train", "sft"}
"""Driver commands whose ranks run as srun tasks on every node (jobs/train_multinode.py)."""


def _overrides(args: argparse.Namespace) -> list[str]:
    """The recipe overrides plus the flags mapped onto launcher.* fields (a flag wins over the recipe)."""
    mapped = [f"{key}={getattr(args, flag)}" for flag, key in _FLAG_FIELDS.items() if getattr(args, flag) is not None]
    mapped += ["launcher.requeue=true"] if args.requeue else []
    return [*args.overrides, *mapped]


def driver_command(command: str, python: str, config_path: Path, nodes: int, tasks_per_node: int) -> list[str]:
    """The driver the job runs on its first node: `sao train|sft` (which start their ranks as srun
    tasks on every node), another recipe sub-command (`value-pretrain train`, `config show`, ...)
    on the resolved config, or `convert ...` as it is given, one srun task per rank
    (`nodes x tasks_per_node`; the conversion adopts Slurm's task variables)."""
    words = shlex.split(command)
    if not words:
        raise ValueError("--command is empty: name a sao sub-command, e.g. train")
    if words[0] == "convert":
        return ["srun", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes * tasks_per_node}",
                f"--ntasks-per-node={tasks_per_node}", "--kill-on-bad-exit=1", python, "-m", "megatron_sao.cli",
                *words]
    module = "megatron_sao.jobs.train_multinode" if words[0] in TRAINER_COMMANDS else "megatron_sao.cli"
    return [python, "-m", module, *words, str(config_path), "checkpoint.resume=auto"]


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


def engine_component(config, args: argparse.Namespace, gpus: int) -> tuple[int, list[str]]:
    """(engine nodes, #SBATCH lines of the job's second component) for a heterogeneous job with
    the rollout engines on `--engine-partition`; (0, []) otherwise. The engine nodes are the
    planner's (disaggregated SGLang engines), or `--engine-nodes` (e.g. CPU engines)."""
    if not args.engine_partition:
        if args.engine_nodes is not None:
            raise ValueError("--engine-nodes needs --engine-partition (the partition the engine nodes come from)")
        return 0, []
    from megatron_sao.planning.placement import gpu_layout

    nodes = args.engine_nodes if args.engine_nodes is not None else gpu_layout(config).engine_nodes
    if nodes < 1 or nodes >= config.launcher.nnodes:
        raise ValueError(f"--engine-partition {args.engine_partition}: {nodes} engine nodes of launcher.nnodes="
                         f"{config.launcher.nnodes} leave no trainer or no engine node; engines need their own GPUs "
                         "(disaggregated placement: parallelism.world_size below the allocation) or --engine-nodes N")
    lines = ["#SBATCH hetjob", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --partition={args.engine_partition}"]
    lines += [f"#SBATCH --account={config.launcher.account}"] if config.launcher.account else []
    lines += [f"#SBATCH --gpus-per-node={gpus}"] if gpus else []
    return nodes, lines


def render_script(config, args: argparse.Namespace, run_dir: Path, config_path: Path) -> str:
    """The job script for `config` (resolved) with the command-line choices in `args`."""
    launcher = config.launcher
    gpus = args.gpus_per_node if args.gpus_per_node is not None else (
        launcher.nproc_per_node if config.rollout.engine == "sglang" else 0)
    engine_nodes, engine_lines = engine_component(config, args, gpus)
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
    driver = driver_command(args.command, python, config_path, launcher.nnodes - engine_nodes,
                            launcher.nproc_per_node)
    if launcher.container_image:  # the batch shell runs on the host: the driver needs its own step
        driver = ["srun", *srun_extra, "--overlap", "--nodes=1", "--ntasks=1", "-w", "$HEAD", *driver]
    fields = {
        "JOB_NAME": f"sao-{config.run.name}", "NODES": str(launcher.nnodes - engine_nodes),
        "HET": "1" if engine_nodes else "0", "RUN_DIR": shlex.quote(str(run_dir)),
        "TASKS_PER_NODE": str(launcher.nproc_per_node),
        "SBATCH_LINES": "\n".join(lines), "REQUEUE": "1" if launcher.requeue else "0", "GPUS_PER_NODE": str(gpus),
        "CPUS_PER_NODE": str(args.cpus_per_node), "NET_IFACE": shlex.quote(launcher.network_interface),
        "PORT_RANGE": shlex.quote(launcher.port_range), "JOIN_TIMEOUT": str(launcher.join_timeout_s),
        "ALLOW_LOOPBACK": "1" if args.allow_loopback else "0", "PYTHON": shlex.quote(python),
        "SRUN_EXTRA": " ".join(shlex.quote(s) for s in srun_extra), "WORKDIR": shlex.quote(str(REPO)),
        "DRIVER": " ".join('"$HEAD"' if s == "$HEAD" else shlex.quote(s) for s in driver),
    }
    text = TEMPLATE.read_text()
    for key, value in fields.items():
        text = text.replace("{{" + key + "}}", value)
    if leftover := re.findall(r"\{\{[A-Z_]+\}\}", text):
        raise AssertionError(f"template fields left unfilled: {leftover}")
    return text


def write_job(args: argparse.Namespace) -> tuple[Path, object]:
    """Load the recipe, write config + script into the run directory; return (script, config)."""
    from megatron_sao.config import dump_config, load_config

    config = load_config(args.recipe, [*_overrides(args), "launcher.kind=slurm"])
    config.run.output_dir = str(Path(config.run.output_dir).resolve())  # the job runs from the repository
    run_dir = Path(config.run.output_dir) / config.run.name
    launch_dir = run_dir / "launch"
    launch_dir.mkdir(parents=True, exist_ok=True)
    config_path = dump_config(config, launch_dir / "config.yaml")
    script = launch_dir / "sao_job.sbatch"
    script.write_text(render_script(config, args, run_dir, config_path))
    script.chmod(0o755)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    if check.returncode:
        raise ValueError(f"generated script {script} does not parse: {check.stderr.strip()}")
    return script, config


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


def _cmd_slurm(args: argparse.Namespace) -> int:
    script, _ = write_job(args)
    print(f"sbatch script: {script}", flush=True)
    if args.dry_run:
        return 0
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if out.returncode:
        print(f"sao launch: sbatch failed: {out.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = out.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}", flush=True)
    return wait_for_job(job_id, script.parent.parent) if args.wait else 0


def _cmd_local(args: argparse.Namespace) -> int:
    from megatron_sao.config import dump_config, load_config

    config = load_config(args.recipe, [*args.overrides, "launcher.kind=local"])
    config.run.output_dir = str(Path(config.run.output_dir).resolve())  # the driver runs from the repository
    run_dir = Path(config.run.output_dir) / config.run.name
    config_path = dump_config(config, run_dir / "launch" / "config.yaml")
    cmd = ["bash", str(LOCAL_SCRIPT), str(config_path), sys.executable, args.command, str(args.cpus_per_node)]
    return subprocess.run(cmd, cwd=REPO).returncode


def _user_errors(run):
    def wrapped(args: argparse.Namespace) -> int:
        from megatron_sao.config import ConfigError

        try:
            return run(args)
        except (ConfigError, ValueError) as e:
            print(f"sao launch: {'config error: ' if isinstance(e, ConfigError) else ''}{e}", file=sys.stderr)
            return 2
    return wrapped


def add_launch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `sao launch {slurm,local}`."""
    launch = subparsers.add_parser("launch", help="run a recipe on Slurm or locally (Ray cluster + driver)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = launch.add_subparsers(dest="launch_kind", required=True, metavar="WHERE")
    for kind in ("slurm", "local"):
        p = sub.add_parser(kind, help=f"launch on {'a Slurm allocation' if kind == 'slurm' else 'this machine'}")
        p.add_argument("recipe", help="recipe YAML file")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
        p.add_argument("--command", default="train", help="sao sub-command the driver runs (default: train)")
        p.add_argument("--cpus-per-node", type=int, default=1, help="CPUs each Ray node offers (default 1)")
        if kind == "local":
            p.set_defaults(func=_user_errors(_cmd_local))
            continue
        p.add_argument("--nodes", type=int, help="nodes (launcher.nnodes)")
        p.add_argument("--gpus-per-node", type=int, help="GPUs per node (launcher.nproc_per_node)")
        p.add_argument("--partition", help="launcher.partition")
        p.add_argument("--account", help="launcher.account")
        p.add_argument("--time", help="launcher.time_limit, e.g. 24:00:00")
        p.add_argument("--container", help="container image (pyxis/enroot; launcher.container_image)")
        p.add_argument("--requeue", action="store_true", help="requeue after a time-limit checkpoint and resume "
                                                               "(launcher.requeue=true)")
        p.add_argument("--engine-partition", help="heterogeneous job: rollout engines on nodes of this partition")
        p.add_argument("--engine-nodes", type=int, help="engine nodes of a heterogeneous job (default: the planner's "
                                                         "count for disaggregated SGLang engines)")
        p.add_argument("--dry-run", action="store_true", help="write and check the script, do not submit")
        p.add_argument("--wait", action="store_true", help="wait for the job; exit with its exit code")
        p.add_argument("--interface", help="network interface to advertise (launcher.network_interface; "
                                            "default: by hostname)")
        p.add_argument("--allow-loopback", action="store_true", help="allow a 127.x address (single-host tests)")
        p.add_argument("--port-range", help="ports the job takes a block of (launcher.port_range)")
        p.add_argument("--join-timeout", type=int, help="seconds to wait for every node to join Ray "
                                                         "(launcher.join_timeout_s)")
        p.set_defaults(func=_user_errors(_cmd_slurm))
    return launch
