"""What a job checks in its parent process, before any rank starts or any model is built.

A user error found on the ranks costs a model build per rank (tens of seconds to minutes at
scale) and, on Slurm, a place in the queue; the same error found here costs a second and comes
out as one line (exit 2). So the drivers (`sao train` / `sao sft`, `sao value-pretrain train`,
and `sao launch slurm` before it writes its script) check here what they can without a model:
the trajectory source, the weights each role starts from, and that the output directories can
be written; `sao launch` also checks the command the job will run and the launcher's fields
(`jobs/launch_checks.py`). What only the ranks can find (a bad row deep in a file, a
shard whose bytes are corrupt) still comes back from them as the user error it is
(`platform.spawn.RankUserError`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from megatron_sao.config.schema import SaoConfig

JobMode = Literal["rl", "sft", "critic"]

def check_writable_dir(path: str | Path, what: str) -> Path:
    """Create directory `path` (with its parents) when it is missing and write a probe file in it.
    ValueError naming `what` and the path when that fails: a file where a directory should be, a
    read-only file system, no permission."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == path else f" ({existing} is one)"
        raise ValueError(f"{what} {path}: a file is in the way, not a directory{where}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".sao-write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write there ({e.strerror or e})") from e
    return path


def roles_built(config: SaoConfig, mode: JobMode) -> list[str]:
    """The roles a trainer in `mode` builds (as `training.trainer.SaoTrainer` decides)."""
    from megatron_sao.training.advantages import needs_critic

    roles = [] if mode == "critic" else ["actor"]
    if mode == "critic" or (mode == "rl" and needs_critic(config.algorithm)):
        roles.append("critic")
    return roles


def check_weights_to_load(config: SaoConfig, mode: JobMode) -> None:
    """`actor.load` / `critic.load` of the roles the job builds name a checkpoint of that role
    (`training.checkpoint.weights.resolve_weights_dir`: manifests only; the ranks check digests)."""
    from megatron_sao.training.checkpoint.weights import resolve_weights_dir

    for role in roles_built(config, mode):
        if path := getattr(config, role).load:
            resolve_weights_dir(Path(path), role)


def check_model_files(config: SaoConfig) -> None:
    """`model.hf_path` is what the job builds its models from: a directory with config.json, and
    with weights when `model.load_weights` (megatron-bridge loads them into every role, before a
    `<role>.load` replaces them). A tiny checkpoint (`model.build_tiny`) is built by the job."""
    from megatron_sao.models.hf_files import INDEX_FILE

    model = config.model
    if model.build_tiny:
        return
    if not model.hf_path:
        raise ValueError("model.hf_path is empty: set it to a HuggingFace checkpoint directory")
    path = Path(model.hf_path)
    if not (path / "config.json").is_file():
        what = "no such directory" if not path.is_dir() else "no config.json there (not a HuggingFace checkpoint)"
        raise ValueError(f"model.hf_path={path}: {what}")
    if model.load_weights and not (path / INDEX_FILE).is_file() and not any(path.glob("*.safetensors")):
        raise ValueError(f"model.hf_path={path}: no model weights (no {INDEX_FILE} and no *.safetensors), and "
                         "model.load_weights=true: point it at the full checkpoint, or set model.load_weights=false "
                         "to start from random weights")


def check_outputs(config: SaoConfig) -> None:
    """The run directory and, when set apart, `checkpoint.dir` can be written."""
    from megatron_sao.training.run_dir import run_dir_of

    check_writable_dir(run_dir_of(config), "run directory (run.output_dir/run.name)")
    if config.checkpoint.dir:
        check_writable_dir(Path(config.checkpoint.dir), "checkpoint.dir")


def check_trajectory_source(config: SaoConfig, mode: str) -> None:
    """The files the run's trajectory source reads exist (a clear error before anything starts)."""
    if mode == "rl" and config.rollout.source == "engine":
        if not Path(config.data.train_path).is_file():
            raise ValueError(f"data.train_path={config.data.train_path!r}: no such prompt file (rollout.source=engine "
                             "rolls out the prompts of data.train_path)")
        if config.eval.every_n_steps and not Path(config.eval.prompts_path).is_file():
            raise ValueError(f"eval.prompts_path={config.eval.prompts_path!r}: no such prompt file (eval.every_n_steps="
                             f"{config.eval.every_n_steps} rolls out held-out prompts from it)")
    elif not config.data.trajectories_path:
        raise ValueError("data.trajectories_path is empty: set it to a Parquet or JSONL file of trajectories")
    elif not Path(config.data.trajectories_path).is_file():
        raise ValueError(f"data.trajectories_path={config.data.trajectories_path!r}: no such file")
    else:
        from megatron_sao.rollout.recorded import check_trajectory_file

        check_trajectory_file(config.data.trajectories_path)  # empty, no rows, wrong schema: here, not on ranks


def check_train_job(config: SaoConfig, mode: Literal["rl", "sft"]) -> None:
    """`sao train` / `sao sft`: the trajectory source (a recorded file's format, rows and columns; the
    prompt file of engines), the model checkpoint and the weights to start from, the output
    directories."""
    check_trajectory_source(config, mode)
    check_model_files(config)
    check_weights_to_load(config, mode)
    check_outputs(config)


def check_value_pretrain_job(config: SaoConfig) -> None:
    """`sao value-pretrain train`: the settings, the corpus manifest and its shards' Parquet footers
    (`value_pretrain.on_bad_shard` decides what a bad one does; the ranks check the bytes' digests),
    the critic's starting weights, the output directories."""
    from megatron_sao.config.validate import data_parallel_size
    from megatron_sao.valuepretrain.check import check_shards, handle_bad_shards
    from megatron_sao.valuepretrain.corpus import read_manifest
    from megatron_sao.valuepretrain.settings import check_value_pretrain_config, corpus_dir_of
    from megatron_sao.valuepretrain.stream import RankStream

    check_value_pretrain_config(config, for_training=True)
    corpus_dir = corpus_dir_of(config)
    manifest = read_manifest(corpus_dir)
    bad = check_shards(corpus_dir, manifest.shards, verify_hash=False)
    if bad and config.value_pretrain.on_bad_shard == "stop":
        handle_bad_shards(bad, "stop")  # with "skip" the ranks report them, once
    train = [s for s in manifest.split("train") if s.name not in {p.name for p in bad}]
    RankStream(corpus_dir, train, config.run.seed, 0, data_parallel_size(config))  # enough row groups per rank
    check_model_files(config)
    check_weights_to_load(config, "critic")
    check_outputs(config)
