"""`sao value-pretrain generate | train`: a rollout corpus from the policy, then the critic trained on it.

    sao value-pretrain generate RECIPE.yaml [overrides]   # engines + agent loop -> sharded Parquet + manifest
    sao value-pretrain train RECIPE.yaml [overrides]      # the critic alone, streamed, resumable

`train` follows `sao train`'s run-directory rules (resume from the latest checkpoint, never mix
runs, SIGTERM/SIGINT -> checkpoint and exit 143). RL then starts its critic from the result with
`critic.load=<run dir>/checkpoints`. Details: docs/value-pretraining.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from megatron_sao.config.schema import SaoConfig
from megatron_sao.jobs.args import add_recipe_args, load_recipe


def run_pretrain(config: SaoConfig) -> tuple[int, dict[str, Any], Path]:
    """Train the critic on its ranks: `launcher.nproc_per_node` local processes, srun tasks over
    the allocation's nodes inside a Slurm job (launcher.kind=slurm), or Ray actors (launcher.ray),
    as `sao train` (`platform/launch.py`). Returns (exit code, rank 0's result, run directory)."""
    from megatron_sao.config.validate import trainer_world_size
    from megatron_sao.jobs.preflight import check_value_pretrain_job
    from megatron_sao.models.build import check_layout_fits_model
    from megatron_sao.platform.launch import launch_ranks, rank_launcher
    from megatron_sao.training.loop import STOPPED_BY_SIGNAL
    from megatron_sao.training.run_dir import prepare_resume, run_dir_of
    from megatron_sao.utils.console import show_output
    from megatron_sao.valuepretrain.train_loop import pretrain_rank

    check_value_pretrain_job(config)
    where = rank_launcher(config.launcher, "run through `sao launch slurm --command \"value-pretrain train\"`")
    run_dir = run_dir_of(config) if where == "local" else run_dir_of(config).resolve()  # ranks elsewhere: absolute
    ray = None
    if where == "ray":  # the critic's ranks in a placement group of their own (no engines)
        from megatron_sao.pipeline.placement import ray_ranks_plan

        ray = ray_ranks_plan(config, with_engines=False)
    check_layout_fits_model(config)
    show_output()  # the checks are done: what follows (and the ranks' progress) is shown live
    resume_from, complete = prepare_resume(config, run_dir)
    if complete is not None:
        return 0, {"step": complete, "stopped": False, "metrics": {}, "heldout": None}, run_dir
    result = launch_ranks(pretrain_rank, trainer_world_size(config), config, str(run_dir),
                          str(resume_from) if resume_from else None, launcher=config.launcher, run_dir=run_dir,
                          ray=ray, announce=f"run directory: {run_dir} (resolved config: {run_dir / 'config.yaml'})")
    return (STOPPED_BY_SIGNAL if result["stopped"] else 0), result, run_dir


def _cmd_generate(args: argparse.Namespace) -> int:
    from megatron_sao.jobs.preflight import check_outputs
    from megatron_sao.training.loop import STOPPED_BY_SIGNAL
    from megatron_sao.utils.console import show_output
    from megatron_sao.valuepretrain.generate import run_generate

    config = load_recipe(args)
    check_outputs(config)
    show_output()
    result = run_generate(config)
    totals = result.manifest.totals()
    train, heldout = totals["train"], totals["heldout"]
    how = "stopped by a signal; rerun to continue" if result.stopped else "complete"
    print(f"corpus {result.corpus_dir} {how}: {result.shards_written} shard(s) written, {result.shards_skipped} "
          f"already there; train {train['trajectories']} trajectories / {train['tokens']} tokens (reward mean "
          f"{train['reward']['mean']}), held-out {heldout['trajectories']} / {heldout['tokens']}", flush=True)
    return STOPPED_BY_SIGNAL if result.stopped else 0


def _cmd_train(args: argparse.Namespace) -> int:
    code, result, run_dir = run_pretrain(load_recipe(args))
    heldout = result.get("heldout")
    if heldout is None:
        shown = "no held-out evaluation"
    else:
        ev = heldout["explained_variance"]
        shown = (f"held-out explained variance {'undefined' if ev is None else f'{ev:.4f}'}, value MSE "
                 f"{heldout['value_mse']:.4g}, calibration error {heldout['calibration_error']:.4g}")
    how = "stopped by a signal after its checkpoint; rerun to resume" if result.get("stopped") else "finished"
    print(f"value pretraining {how} at step {result['step']} ({run_dir}): {shown}", flush=True)
    return code


def add_value_pretrain_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "value-pretrain", help="value pretraining: generate a rollout corpus, train the critic on it",
        description="Value pretraining (docs/value-pretraining.md): `generate` rolls out the policy "
                    "(model.hf_path) value_pretrain.samples_per_prompt times per prompt of data.train_path and writes "
                    "a sharded Parquet corpus with a manifest to value_pretrain.corpus_dir (resumable); `train` trains "
                    "the critic alone on it, streamed by row group across data-parallel ranks, with held-out "
                    "explained variance and calibration, checkpoints and exact resume. RL starts from it with "
                    "critic.load=RUN_DIR/checkpoints.")
    actions = parser.add_subparsers(dest="value_pretrain_command", required=True, metavar="ACTION")
    generate = actions.add_parser("generate", help="roll out the policy into a sharded corpus",
                                  description="Start the rollout engines (rollout.engine), run the agent loop over "
                                              "the prompts and write shards + manifest. Complete shards are skipped "
                                              "on a rerun; SIGTERM/SIGINT: stop after the complete shards, exit 143.")
    add_recipe_args(generate)
    generate.set_defaults(func=_cmd_generate, quiet_log="until_started")
    train = actions.add_parser("train", help="train the critic on the corpus",
                               description="Critic only, run.total_steps steps of data.batch_size trajectories; "
                                           "writes config.yaml, metrics.jsonl, calibration.json/.png, "
                                           "data_report.json and checkpoints/ into run.output_dir/run.name; resumes "
                                           "from the latest checkpoint there. SIGTERM/SIGINT: checkpoint, exit 143.")
    add_recipe_args(train)
    train.set_defaults(func=_cmd_train, quiet_log="until_started")
