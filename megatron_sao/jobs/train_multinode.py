"""`sao train` / `sao sft` inside a Slurm allocation: one trainer rank per srun task, on every node.

`jobs.train.run_train` spawns its ranks on the local machine; in a Slurm job the ranks are the
tasks of one srun step instead (`platform.srun.run_srun`: `launcher.nproc_per_node` per node, as
many nodes as `parallelism.world_size` needs). The driver here (on the job's first node) does what
must happen once, before any rank starts (resolve the checkpoint to resume from, write the run
directory's config, check the layout against the model), then every task runs
`jobs.train.train_rank`, the same function the local ranks run: same checkpoints, metrics and
exit codes (143 after a signal-triggered checkpoint).

The job script of `sao launch slurm` runs it as the driver for `--command train|sft`:

    python -m megatron_sao.jobs.train_multinode {train|sft} CONFIG.yaml [overrides]

with MASTER_ADDR / MASTER_PORT exported (the head's advertised IP, a port of the job's block).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Literal

from megatron_sao.config.schema import SaoConfig
from megatron_sao.utils.args import SaoArgumentParser


def run_train_srun(config: SaoConfig, mode: Literal["rl", "sft"] = "rl") -> tuple[int, dict[str, Any], Path]:
    """`run_train` for a Slurm allocation (launcher.kind=slurm, any launcher.nnodes). Returns
    (exit code, rank 0's result, run directory)."""
    from megatron_sao.config.validate import trainer_world_size
    from megatron_sao.jobs.preflight import check_train_job
    from megatron_sao.jobs.train import drive, train_rank
    from megatron_sao.platform.srun import run_srun
    from megatron_sao.training.run_dir import run_dir_of

    check_train_job(config, mode)
    run_dir = run_dir_of(config).resolve()
    world = trainer_world_size(config)

    def launch(resume_from: str | None) -> dict[str, Any]:
        print(f"run directory: {run_dir}; {world} trainer ranks as srun tasks, "
              f"{min(world, config.launcher.nproc_per_node)} per node", flush=True)
        return run_srun(train_rank, world, config, str(run_dir), mode, resume_from,
                        ntasks_per_node=config.launcher.nproc_per_node, work_dir=run_dir / "launch")[0]

    return drive(config, run_dir, launch)

def _run(args: argparse.Namespace) -> int:
    from megatron_sao.config import load_config

    mode: Literal["rl", "sft"] = "sft" if args.job == "sft" else "rl"
    code, result, run_dir = run_train_srun(load_config(args.recipe, args.overrides), mode)
    metrics = result.get("metrics") or {}
    shown = ", ".join(f"{k}={metrics[k]:.4g}" for k in ("actor/loss", "critic/value_loss", "critic/explained_variance",
                                                          "train/reward_mean") if k in metrics)
    how = "stopped by a signal after its checkpoint; rerun to resume" if result.get("stopped") else "finished"
    print(f"{mode} {how} at step {result['step']} ({run_dir}){': ' + shown if shown else ''}", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Exit codes as `sao train` (docs/exit-codes.md)."""
    from megatron_sao.utils.console import run_command

    parser = SaoArgumentParser(prog="python -m megatron_sao.jobs.train_multinode",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", choices=("train", "sft"))
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command(f"sao {args.job}", _run, args)


if __name__ == "__main__":
    sys.exit(main())
