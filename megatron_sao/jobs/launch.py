"""`sao launch slurm|local RECIPE [overrides] [flags]`: run a recipe's driver on a cluster.

slurm: checks everything it can before writing anything (`check_launch`: the layout against the
nodes and GPUs, as `sao plan` does; `--command` against the sub-commands; `--port-range`,
`--time`; the data, model and checkpoint paths the command needs, on the shared file system; that
the run directory can be written), fills the job template (`platform/slurm_job.py`) for the recipe, writes
it with the resolved config into a directory of its own under `<run dir>/launch/`
(`submit-<time>-<id>/`, or `dry-run/` with `--dry-run`: no submitted job reads that one; a job
pending or running for the same run directory keeps reading its own), prints
`sbatch script: PATH`, checks it (`bash -n`, container paths), submits it with sbatch unless
`--dry-run`, and with `--wait` follows the job and exits with its exit code. The job forms a
Ray cluster over its nodes, runs the driver (`sao train` on the resolved config with
`checkpoint.resume=auto`, its ranks as srun tasks on every node; or another `sao` sub-command
via `--command`) and propagates its exit code; see the template for signals, requeue and node
failure. `--engine-partition` makes it a heterogeneous job with the rollout engines on another
partition.

local: the same checks and flow on this machine without Slurm (launchers/local/run.sh).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

from megatron_sao.platform.slurm_job import check_container_paths, fill_job_template, wait_for_job
from megatron_sao.utils.args import SaoArgumentParser, int_at_least, slurm_time

REPO = Path(__file__).resolve().parents[2]
LOCAL_SCRIPT = REPO / "launchers" / "local" / "run.sh"
_FLAG_FIELDS = {"nodes": "launcher.nnodes", "gpus_per_node": "launcher.nproc_per_node",
                "partition": "launcher.partition", "account": "launcher.account", "time": "launcher.time_limit",
                "container": "launcher.container_image", "interface": "launcher.network_interface",
                "port_range": "launcher.port_range", "join_timeout": "launcher.join_timeout_s"}
RECIPE_COMMANDS = ("train", "sft", "value-pretrain train", "value-pretrain generate", "config show")
"""`--command`s the driver runs on the resolved recipe (`sao <command> CONFIG checkpoint.resume=auto`);
`convert ...` is the other kind, run as given."""


def _overrides(args: argparse.Namespace) -> list[str]:
    """The recipe overrides plus the flags mapped onto launcher.* fields (a flag wins over the recipe)."""
    mapped = [f"{key}={getattr(args, flag)}" for flag, key in _FLAG_FIELDS.items()
              if getattr(args, flag, None) is not None]
    mapped += ["launcher.requeue=true"] if getattr(args, "requeue", False) else []
    return [*args.overrides, *mapped]


class _ParseError(ValueError):
    pass


class _RaisingParser(SaoArgumentParser):
    """The `sao` parsers, raising instead of exiting: to check a `--command` before submitting it."""

    def error(self, message: str):  # type: ignore[override]
        raise _ParseError(message)


def check_driver_command(command: str) -> list[str]:
    """The words of `--command`, when the job can run them: a recipe command (`RECIPE_COMMANDS`) or
    a `convert` command that `sao convert`'s own parser accepts. ValueError naming the choices."""
    from megatron_sao.jobs.convert import add_convert_parser

    words = shlex.split(command)
    if not words:
        raise ValueError("--command is empty: name a sao sub-command, e.g. train")
    if words[0] == "convert":
        parser = _RaisingParser(prog="sao")
        add_convert_parser(parser.add_subparsers(dest="command", required=True))
        try:
            parser.parse_args(words)
        except _ParseError as e:
            raise ValueError(f"--command {command!r}: {e}") from None
        return words
    if " ".join(words) not in RECIPE_COMMANDS:
        raise ValueError(f"--command {command!r}: not a sub-command the job can run; one of "
                         f"{', '.join(repr(c) for c in RECIPE_COMMANDS)}, or 'convert hf-to-mcore|mcore-to-hf|verify "
                         "...' (its own flags)")
    return words


def check_launch(config, command: list[str], recipe: str) -> None:
    """Before anything is written: what the job would otherwise find after queueing. The layout
    against the nodes and GPUs (`sao plan`'s checks), the launcher's port range and time limit, the
    files the command reads (as paths on the shared file system) and the run directory. ValueError
    / ConfigError naming the key, flag or path."""
    from megatron_sao.jobs import preflight
    from megatron_sao.jobs.plan import check_recipe_layout
    from megatron_sao.platform.slurm import job_port_block, parse_port_range
    from megatron_sao.utils.args import check_slurm_time

    launcher = config.launcher
    try:
        job_port_block(0, parse_port_range(launcher.port_range))
    except ValueError as e:
        raise ValueError(f"launcher.port_range (--port-range): {e}") from None
    try:
        check_slurm_time(launcher.time_limit)
    except ValueError as e:
        raise ValueError(f"launcher.time_limit (--time): {e}") from None
    name = " ".join(command)
    if command[0] != "convert" and name != "config show":
        check_recipe_layout(config, source=recipe)
    if name in ("train", "sft"):
        preflight.check_train_job(config, "sft" if name == "sft" else "rl")
    elif name == "value-pretrain train":
        preflight.check_value_pretrain_job(config)
    elif name == "value-pretrain generate":
        from megatron_sao.valuepretrain.settings import check_value_pretrain_config

        check_value_pretrain_config(config, for_training=False)
        preflight.check_model_files(config)
        if not Path(config.data.train_path).is_file():
            raise ValueError(f"data.train_path={config.data.train_path!r}: no such prompt file (value-pretrain "
                             "generate rolls out its prompts)")
        preflight.check_outputs(config)
    else:
        preflight.check_outputs(config)


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


def engine_component(config, args: argparse.Namespace, gpus: int) -> tuple[int, list[str]]:
    """(engine nodes, #SBATCH lines of the job's second component) for a heterogeneous job with
    the rollout engines on `--engine-partition`; (0, []) otherwise. The engine nodes are the
    planner's (disaggregated SGLang engines), or `--engine-nodes` (e.g. CPU engines)."""
    if not args.engine_partition:
        if args.engine_nodes is not None:
            raise ValueError("--engine-nodes needs --engine-partition (the partition the engine nodes come from)")
        return 0, []
    from megatron_sao.config.placement import gpu_layout

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
    driver = driver_command(args.driver_command, python, config_path, launcher.nnodes - engine_nodes,
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
    return fill_job_template(fields)


def resolve_launch(args: argparse.Namespace, kind: str) -> tuple[object, Path, list[str]]:
    """(resolved config, run directory, driver command words) once `check_launch` passed."""
    from megatron_sao.config import load_config

    command = check_driver_command(args.driver_command)
    config = load_config(args.recipe, [*_overrides(args), f"launcher.kind={kind}"])
    config.run.output_dir = str(Path(config.run.output_dir).resolve())  # the job runs from the repository
    run_dir = Path(config.run.output_dir) / config.run.name
    check_launch(config, command, args.recipe)
    from megatron_sao.jobs.preflight import check_writable_dir

    check_writable_dir(run_dir / "launch", "run directory (run.output_dir/run.name)")
    return config, run_dir, command


def submission_dir(run_dir: Path, dry_run: bool) -> Path:
    """Where one launch writes its config and script: `<run dir>/launch/dry-run/` (replaced by the next
    dry run; no job reads it), else a new `<run dir>/launch/submit-<time>-<id>/` that only the job
    submitted from it reads, at its start and after every requeue."""
    launch_dir = run_dir / "launch"
    if dry_run:
        return launch_dir / "dry-run"
    return launch_dir / f"submit-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def write_job(args: argparse.Namespace) -> tuple[Path, object, Path]:
    """Check the launch (`resolve_launch`), then write config + script into their own directory
    (`submission_dir`); return (script, config, run directory). A script that fails its checks
    leaves no new directory behind."""
    import shutil

    from megatron_sao.config import dump_config

    config, run_dir, _ = resolve_launch(args, "slurm")
    out_dir = submission_dir(run_dir, args.dry_run)
    if args.dry_run:
        shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    try:
        config_path = dump_config(config, out_dir / "config.yaml")
        text = render_script(config, args, run_dir, config_path)
        check = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        if check.returncode:
            raise AssertionError(f"generated script does not parse: {check.stderr.strip()}")
        script = out_dir / "sao_job.sbatch"
        script.write_text(text)
        script.chmod(0o755)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return script, config, run_dir


def _cmd_slurm(args: argparse.Namespace) -> int:
    from megatron_sao.utils.console import console_err, show_output

    script, _, run_dir = write_job(args)
    show_output()
    print(f"sbatch script: {script}", flush=True)
    if args.dry_run:
        return 0
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if out.returncode:
        print(f"sao launch: sbatch failed: {out.stderr.strip()}", file=console_err(), flush=True)
        return 1
    job_id = out.stdout.strip().split(";")[0]
    (script.parent / "job_id").write_text(job_id + "\n")
    print(f"submitted job {job_id}", flush=True)
    return wait_for_job(job_id, run_dir) if args.wait else 0


def _cmd_local(args: argparse.Namespace) -> int:
    from megatron_sao.config import dump_config
    from megatron_sao.utils.console import show_output

    config, run_dir, command = resolve_launch(args, "local")
    config_path = dump_config(config, run_dir / "launch" / "config.yaml")
    show_output()
    cmd = ["bash", str(LOCAL_SCRIPT), str(config_path), sys.executable, " ".join(command), str(args.cpus_per_node)]
    return subprocess.run(cmd, cwd=REPO).returncode


def add_launch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `sao launch {slurm,local}`."""
    launch = subparsers.add_parser("launch", help="run a recipe on Slurm or locally (Ray cluster + driver)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = launch.add_subparsers(dest="launch_kind", required=True, metavar="WHERE")
    for kind in ("slurm", "local"):
        p = sub.add_parser(kind, help=f"launch on {'a Slurm allocation' if kind == 'slurm' else 'this machine'}",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("recipe", help="recipe YAML file")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
        p.add_argument("--command", dest="driver_command", default="train",
                       help=f"sao sub-command the driver runs on the resolved recipe: one of "
                            f"{', '.join(RECIPE_COMMANDS)}" + (", or 'convert ...' with its own flags (one srun "
                                                               "task per rank)" if kind == "slurm" else "")
                            + " (default: train)")
        p.add_argument("--cpus-per-node", type=int_at_least(1), default=1, help="CPUs each Ray node offers (default 1)")
        p.add_argument("--log-file", help="where third-party output of the checks goes (default: a new file in the "
                                          "temp directory); -v keeps it on the terminal")
        p.set_defaults(quiet_log="until_started")
        if kind == "local":
            p.set_defaults(func=_cmd_local)
            continue
        p.add_argument("--nodes", type=int_at_least(1), help="nodes (launcher.nnodes)")
        p.add_argument("--gpus-per-node", type=int_at_least(0), help="GPUs per node (launcher.nproc_per_node)")
        p.add_argument("--partition", help="launcher.partition")
        p.add_argument("--account", help="launcher.account")
        p.add_argument("--time", type=slurm_time, help="launcher.time_limit: minutes, HH:MM:SS or D-HH:MM:SS, e.g. "
                                                        "24:00:00")
        p.add_argument("--container", help="container image (pyxis/enroot; launcher.container_image)")
        p.add_argument("--requeue", action="store_true", help="requeue after a time-limit checkpoint and resume "
                                                               "(launcher.requeue=true)")
        p.add_argument("--engine-partition", help="heterogeneous job: rollout engines on nodes of this partition")
        p.add_argument("--engine-nodes", type=int_at_least(1), help="engine nodes of a heterogeneous job (default: "
                                                                     "the planner's count for disaggregated SGLang "
                                                                     "engines)")
        p.add_argument("--dry-run", action="store_true", help="check, and write the script and config into "
                                                               "<run dir>/launch/dry-run/ (no job reads them); do "
                                                               "not submit")
        p.add_argument("--wait", action="store_true", help="wait for the job; exit with its exit code")
        p.add_argument("--interface", help="network interface to advertise (launcher.network_interface; "
                                            "default: by hostname)")
        p.add_argument("--allow-loopback", action="store_true", help="allow a 127.x address (single-host tests)")
        p.add_argument("--port-range", help="ports the job takes a block of 16 from, LOW-HIGH within 1024-65535 "
                                            "(launcher.port_range)")
        p.add_argument("--join-timeout", type=int_at_least(1), help="seconds to wait for every node to join Ray "
                                                                     "(launcher.join_timeout_s)")
        p.set_defaults(func=_cmd_slurm)
    return launch
