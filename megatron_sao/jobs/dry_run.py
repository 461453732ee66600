"""`sao train RECIPE [overrides] --dry-run` (and `sao sft ... --dry-run`): what a run checks and
builds before its first step, without GPUs, peers, data or a run directory.

In order, stopping at the first problem:
1. config: the recipe and overrides load and validate (the CLI, before this);
2. layout: the parallel layout divides the model (`models.build.check_layout_fits_model`, which
   `sao train` calls before it starts ranks);
3. plan: `sao plan`'s verdict on the recipe's `launcher.gpu_type` (`jobs.plan.build_plan`: also the
   trainer world against the nodes, and the engines' placement);
4. features: everything the recipe asks for is built (`training.features.check_features_built`,
   the call `SaoTrainer` makes at start);
5. build: rank 0 of the recipe's world builds the trainer (`training/shape_build.py`; `SaoTrainer`:
   the actor, the critic when the estimator needs one, their Megatron DDP wrappers, optimizers and
   LR schedules) in a fake world (`platform/fake_world.py`: fake process group of the recipe's
   world size, meta tensors), at the recipe's real shapes with no memory behind them; its
   parameter counts are printed beside the plan's for the same rank.
Exit 0 with a summary; 2 with one line naming the key (config, layout, unbuilt feature, missing
config.json); 1 when the plan says the recipe does not fit (as `sao plan`).

What the build is not: it uses the local layer spec in float32, as the trainer does without CUDA
(on GPUs the Transformer Engine spec builds the same parameter shapes in `model.dtype`: TE fuses
each norm into the next linear, the same count); only config.json is read (`model.load_weights`,
`actor.load`, `critic.load` are not read: shapes only); multi-token-prediction layers are not
part of the trained model (`models/build.py`); engines, sandboxes and data are not started or read
(the input files are listed with whether they exist).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megatron_sao.config.schema import SaoConfig
from megatron_sao.training.shape_build import Mode, build_rank0, quiet_libraries, shape_only_config


def _inputs_line(config: SaoConfig, mode: Mode) -> str:
    key = "train_path" if mode == "rl" and config.rollout.source == "engine" else "trajectories_path"
    path = getattr(config.data, key)
    state = "found" if path and Path(path).is_file() else ("not found" if path else "not set")
    return f"data.{key}={path!r}: {state}{'' if state == 'found' else ' (a run needs it)'}"


def _vs(built: int, planned: float) -> str:
    diff = (built - planned) / planned if planned else 0.0
    return f"{built:,} (plan {planned:,.0f}, {diff:+.2%})"


def dry_run(config: SaoConfig, recipe: str, overrides: list[str], mode: Mode, out: Any, err: Any = None) -> int:
    """Run the checks above on `config` (loaded from `recipe` + `overrides`), printing the summary
    to `out` line by line (the verdict of a recipe that does not fit to `err`, default stderr);
    returns the exit code (0, or 1: does not fit); raises ConfigError / ValueError /
    NotImplementedError (exit 2) naming the key."""
    from megatron_sao.jobs.plan import build_plan
    from megatron_sao.models.build import check_layout_fits_model
    from megatron_sao.planning import census_from_hf_config, load_hf_config
    from megatron_sao.training.features import check_features_built

    def emit(line: str) -> None:
        print(line, file=out, flush=True)

    command = "sao train" if mode == "rl" else "sao sft"
    emit(f"{command} --dry-run {' '.join([recipe, *overrides])}: nothing is started or written")
    start = time.perf_counter()
    with quiet_libraries(), tempfile.TemporaryDirectory(prefix="sao-dry-run-") as scratch:
        shape = shape_only_config(config, Path(scratch))
        check_layout_fits_model(shape, source=recipe)
        plan, _ = build_plan(recipe, overrides)
        p, gpus = config.parallelism, plan["gpus"]
        emit(f"  layout    TP {p.tensor} PP {p.pipeline} CP {p.context} EP {p.expert} on {gpus['trainer']} trainer "
             f"GPUs of {gpus['total']} ({plan['architecture']}): divides the model")
        memory = plan["memory_gib_per_gpu"]
        emit(f"  plan      {'fits' if plan['fits'] else 'does not fit'} on {plan['gpu']}: {memory['total']:.1f} of "
             f"{plan['gpu_memory_gib']:.1f} GiB per trainer GPU (largest term: {plan['largest_term']}); engines: "
             f"{gpus['placement']}")
        if not plan["fits"]:
            print(f"{command}: dry run: does not fit on {plan['gpu']}: {'; '.join(plan['problems'])}",
                  file=err or sys.stderr, flush=True)
            return 1
        check_features_built(config, mode)
        emit("  features  everything the recipe asks for is built (training/features.py)")
        census = census_from_hf_config(load_hf_config(config.model))
        t_build = time.perf_counter()
        builds = build_rank0(shape, mode, census)
    emit(f"  build     rank 0 of {gpus['trainer']} (pipeline stage 0) built the trainer in a fake world in "
         f"{time.perf_counter() - t_build:.1f} s: local spec, float32, meta tensors (no memory)")
    for b in builds:
        emit(f"    {b.role:<7} parameters {_vs(b.params, b.plan_params)}; trainable "
             f"{_vs(b.trainable, b.plan_trainable)}; optimizer shard {_vs(b.optimizer_elems, b.plan_optimizer_elems)}")
    emit(f"  inputs    {_inputs_line(config, mode)}")
    emit(f"dry run ok ({time.perf_counter() - start:.1f} s)")
    return 0
