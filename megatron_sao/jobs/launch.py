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
import subprocess
import sys
from pathlib import Path

from megatron_sao.jobs.preflight import RECIPE_COMMANDS, check_driver_command, check_launch, check_writable_dir
from megatron_sao.platform.slurm_job import REPO, JobOptions, wait_for_job, write_job_script
from megatron_sao.utils.args import int_at_least, slurm_time

LOCAL_SCRIPT = REPO / "launchers" / "local" / "run.sh"
_FLAG_FIELDS = {"nodes": "launcher.nnodes", "gpus_per_node": "launcher.nproc_per_node",
                "partition": "launcher.partition", "account": "launcher.account", "time": "launcher.time_limit",
                "container": "launcher.container_image", "interface": "launcher.network_interface",
                "port_range": "launcher.port_range", "join_timeout": "launcher.join_timeout_s"}


def _overrides(args: argparse.Namespace) -> list[str]:
    """The recipe overrides plus the flags mapped onto launcher.* fields (a flag wins over the recipe)."""
    mapped = [f"{key}={getattr(args, flag)}" for flag, key in _FLAG_FIELDS.items()
              if getattr(args, flag, None) is not None]
    mapped += ["launcher.requeue=true"] if getattr(args, "requeue", False) else []
    return [*args.overrides, *mapped]


def resolve_launch(args: argparse.Namespace, kind: str) -> tuple[object, Path, list[str]]:
    """(resolved config, run directory, driver command words) once `check_launch` passed."""
    from megatron_sao.config import load_config

    command = check_driver_command(args.driver_command)
    config = load_config(args.recipe, [*_overrides(args), f"launcher.kind={kind}"])
    config.run.output_dir = str(Path(config.run.output_dir).resolve())  # the job runs from the repository
    run_dir = Path(config.run.output_dir) / config.run.name
    check_launch(config, command, args.recipe)
    check_writable_dir(run_dir / "launch", "run directory (run.output_dir/run.name)")
    return config, run_dir, command


def write_job(args: argparse.Namespace) -> tuple[Path, object, Path]:
    """Check the launch (`resolve_launch`), then write config + script into their own directory
    (`platform.slurm_job.write_job_script`); return (script, config, run directory)."""
    config, run_dir, _ = resolve_launch(args, "slurm")
    options = JobOptions(driver_command=args.driver_command, gpus_per_node=args.gpus_per_node,
                         cpus_per_node=args.cpus_per_node, engine_partition=args.engine_partition,
                         engine_nodes=args.engine_nodes, allow_loopback=args.allow_loopback)
    return write_job_script(config, options, run_dir, args.dry_run), config, run_dir


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
