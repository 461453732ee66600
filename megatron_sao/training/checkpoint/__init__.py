"""Training checkpoints with exact resume: save, find and load every role's model, optimizer,
LR scheduler and RNG state (docs/checkpoints.md).

Each role directory is one Megatron `dist_checkpointing` torch_dist checkpoint. Model keys come
from `checkpointing.keys.model_state` (layout- and layer-spec-free), the keys conversion saves
under too, so a `sao convert hf-to-mcore` output loads as weights (`weights`). The distributed
optimizer is stored `fully_reshardable`: its shards are gathered over DP into per-parameter
tensors keyed by the model key, so the state reshards across TP, PP, EP and DP like the weights
(`dp_reshardable` would only allow a DP change). The plain optimizer is keyed the same way.

All functions taking `roles` are collective: every rank calls them with its own chunks.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_sao.checkpointing.keys import model_state, unwrap
from megatron_sao.platform.collective import (
    barrier,
    broadcast_object,
    gather_objects,
    raise_if_any,
    rank,
    world_size,
)
from megatron_sao.training.checkpoint import files, optim
from megatron_sao.training.checkpoint.files import find_latest_checkpoint
from megatron_sao.training.checkpoint.rng import RNG_KEY, current_layout, rng_object, rng_state, set_rng_state
from megatron_sao.training.checkpoint.weights import load_model_weights
from megatron_sao.training.optim import RoleOptimizer
from megatron_sao.utils.atomic import atomic_write_text

__all__ = ["finalize_async_saves", "find_latest_checkpoint", "load_checkpoint", "load_model_weights",
           "save_checkpoint"]

logger = logging.getLogger(__name__)

_ASYNC: dict[str, Any] = {"queue": None}


def _role_state(role: RoleOptimizer, is_loading: bool, rng: dict[str, Any] | None, with_rng: bool,
                counters: dict[str, int] | None = None) -> dict[str, Any]:
    """The sharded state dict of one role (model + optimizer + scheduler + RNG + counters)."""
    chunks = [unwrap(c) for c in role.chunks]
    state: dict[str, Any] = model_state(chunks)
    state["optimizer"] = optim.sharded_optimizer_state(role.optimizer, dict(state), is_loading)
    state["scheduler"] = role.scheduler.state_dict()
    if counters is not None:
        state["counters"] = counters
    if with_rng:
        state[RNG_KEY] = rng_object(rng)
    return state


def _comparable_common(common: Any) -> Any:
    """Megatron checks the non-tensor state is the same on every rank. With the gloo gather only DP
    rank 0 holds the optimizer's `param_state` (others hold None): not a difference worth a warning."""
    if isinstance(common, dict):
        return {k: _comparable_common(v) for k, v in common.items() if not (k == "param_state" and v is None)}
    return common


def _save_strategy() -> Any:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy(backend="torch_dist", thread_count=2)


def _on_rank0(what: str, fn: Callable[[], None]) -> None:
    """Collective: run `fn` on rank 0 only; its failure is raised on every rank (no rank left waiting)."""
    error = None
    if rank() == 0:
        try:
            fn()
        except Exception as e:
            error = f"{what} failed on rank 0: {type(e).__name__}: {e}"
    error = broadcast_object(error)
    if error:
        raise RuntimeError(error)


def _commit_everywhere(checkpoints_dir: Path, step: int, manifest: files.CheckpointManifest,
                       keep_last: int) -> None:
    """Collective: hash + fsync a share of the files on each rank, then rank 0 writes the manifest,
    renames the partial directory, writes the tracker and prunes."""
    partial = files.partial_dir(checkpoints_dir, step)
    barrier()
    names = files.list_files(partial)
    tables = gather_objects(files.hash_and_sync(partial, files.my_share(names, rank(), world_size())))

    def commit() -> None:
        for table in tables:
            manifest.files.update(table)
        files.write_manifest(partial, manifest)
        _commit(partial, checkpoints_dir / files.iter_dir_name(step))
        files.write_tracker(checkpoints_dir, step)
        files.prune(checkpoints_dir, keep_last)

    _on_rank0(f"saving checkpoint {step} into {checkpoints_dir}", commit)


def _commit(partial: Path, final: Path) -> None:
    """The rename that makes a checkpoint complete (a seam for the kill-during-save test)."""
    files.commit(partial, final)


def save_checkpoint(checkpoints_dir: Path, step: int, roles: dict[str, RoleOptimizer],
                    trainer_state: dict[str, Any], keep_last: int, async_save: bool = False) -> Path:
    """Collective (all ranks). Writes <checkpoints_dir>/iter_{step:07d}/{actor,critic}/ + trainer_state.json
    through `iter_{step:07d}.partial/`, then the tracker; returns the iter dir.

    `async_save` (GPU): the shard writes run in a background process and this returns once the
    tensors are copied to host memory; the directory becomes complete (manifest, rename, tracker,
    pruning) in `finalize_async_saves`, which the trainer calls every step and before exiting. A new
    save first waits for the previous one. Without CUDA the save is synchronous.
    """
    from megatron.core import dist_checkpointing

    checkpoints_dir = Path(checkpoints_dir)
    unknown = sorted(set(roles) - set(files.ROLES))
    if unknown or not roles:
        raise ValueError(f"save_checkpoint: roles must be actor and/or critic, got {sorted(roles)}")
    try:
        state_text = json.dumps(trainer_state, indent=1, sort_keys=True) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_checkpoint: trainer_state must be JSON-serialisable: {e}") from e
    finalize_async_saves(blocking=True)
    partial = files.partial_dir(checkpoints_dir, step)

    def prepare() -> None:
        shutil.rmtree(partial, ignore_errors=True)  # a killed earlier attempt at this step
        for name in roles:
            (partial / name).mkdir(parents=True)
        atomic_write_text(partial / files.TRAINER_STATE_FILE, state_text)

    _on_rank0(f"preparing {partial}", prepare)
    rng = rng_state()
    manifest = files.CheckpointManifest(
        step=step, roles=sorted(roles), layout=current_layout(),
        optimizer_format={name: optim.optimizer_format(role.optimizer) for name, role in roles.items()})
    use_async = async_save and _async_supported()
    if async_save and not use_async:
        logger.info("checkpoint.async_save needs CUDA; saving synchronously")
    requests = []
    for name, role in sorted(roles.items()):
        counters = {"step": step, "optimizer_steps": int(role.scheduler.num_steps)}
        state = _role_state(role, is_loading=False, rng=rng, with_rng=True, counters=counters)
        request = dist_checkpointing.save(state, str(partial / name), sharded_strategy=_save_strategy(),
                                          async_sharded_save=use_async,
                                          preprocess_common_before_consistancy_check=_comparable_common,
                                          async_strategy=_async_strategy() if use_async else "mcore")
        requests.append(request)
    final = checkpoints_dir / files.iter_dir_name(step)
    if not use_async:
        _commit_everywhere(checkpoints_dir, step, manifest, keep_last)
        logger.info("saved checkpoint %s", final)
        return final
    requests[-1].add_finalize_fn(lambda: _commit_everywhere(checkpoints_dir, step, manifest, keep_last))
    queue = _async_queue()
    for request in requests:
        queue.schedule_async_request(request)
    logger.info("checkpoint %s: writing in the background", final)
    return final


def _async_supported() -> bool:
    """Background writes are used with CUDA, where they overlap the write with training. On CPU the
    models are small and a synchronous save is simpler; the tests force this on to run the path."""
    return torch.cuda.is_available()


def _async_strategy() -> str:
    """NVIDIA resiliency-ext's async writer when installed (Megatron's recommendation), else Megatron's own."""
    try:
        import nvidia_resiliency_ext  # noqa: F401
    except ImportError:
        return "mcore"
    return "nvrx"


def _async_queue() -> Any:
    from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

    if _ASYNC["queue"] is None:
        _, queue_cls = get_async_strategy(_async_strategy(), "AsyncCallsQueue")
        _ASYNC["queue"] = queue_cls()
    return _ASYNC["queue"]


def finalize_async_saves(blocking: bool = False) -> None:
    """Collective. Complete background saves that have finished writing (all of them when
    `blocking`). A no-op when no async save was started."""
    if _ASYNC["queue"] is not None:
        _ASYNC["queue"].maybe_finalize_async_calls(blocking=blocking)


def _verify_checkpoint(iter_dir: Path, manifest: files.CheckpointManifest) -> None:
    """Collective: every rank checks its share of the files against the manifest; a bad file is
    reported on all ranks with its path."""
    names = sorted(manifest.files)
    errors = files.verify_files(iter_dir, manifest.files, files.my_share(names, rank(), world_size()))
    raise_if_any(errors)


def load_checkpoint(iter_dir: Path, roles: dict[str, RoleOptimizer]) -> dict[str, Any]:
    """Collective. Restores model, optimizer, scheduler (and RNG when the layout is unchanged) of every
    role in `roles`; returns trainer_state.

    The scheduler keeps the caller's hyperparameters (e.g. a raised `run.total_steps` lengthens
    the decay) and resumes at the saved step count; differences are logged.
    """
    from megatron.core import dist_checkpointing

    iter_dir = Path(iter_dir)
    manifest = files.read_manifest(iter_dir)
    _verify_checkpoint(iter_dir, manifest)
    missing = sorted(set(roles) - set(manifest.roles))
    if missing:
        raise ValueError(f"{iter_dir}: holds roles {manifest.roles}, not {missing}")
    layout = current_layout()
    same_layout = manifest.layout == layout
    if not same_layout:
        logger.info("%s: saved in layout %s, loading into %s: model and optimizer reshard; RNG states are "
                    "not restored", iter_dir, manifest.layout, layout)
    rng = None
    for name, role in sorted(roles.items()):
        saved, now = manifest.optimizer_format[name], optim.optimizer_format(role.optimizer)
        if saved != now:
            raise ValueError(f"{iter_dir / name}: optimizer state saved as {saved!r}, this run's {name} optimizer "
                             f"is {now!r}: set {name}.optim.use_distributed_optimizer as when it was saved")
        state = _role_state(role, is_loading=True, rng=None, with_rng=same_layout)
        optimizer_skeleton = optim.skeleton(state["optimizer"])
        loaded = dist_checkpointing.load(state, str(iter_dir / name))
        chunks = [unwrap(c) for c in role.chunks]
        for key, chunk in zip([k for k in state if k.startswith("model")], chunks, strict=True):
            chunk.load_state_dict(loaded[key], strict=True)
        optim.load_optimizer_state(role.optimizer, optimizer_skeleton, loaded["optimizer"], str(iter_dir / name))
        _load_scheduler(role.scheduler, loaded["scheduler"], f"{iter_dir / name}")
        if same_layout:
            rng = loaded[RNG_KEY]
    if rng is not None:
        set_rng_state(rng)
    trainer_state = json.loads((iter_dir / files.TRAINER_STATE_FILE).read_text())
    logger.info("loaded checkpoint %s (roles %s)", iter_dir, ", ".join(sorted(roles)))
    return trainer_state


def _load_scheduler(scheduler: Any, saved: dict[str, Any], where: str) -> None:
    current = scheduler.state_dict()
    for key in sorted(set(saved) - {"num_steps"}):
        if key in current and current[key] != saved[key]:
            logger.warning("%s: LR scheduler %s is %s in the checkpoint, %s now: using the current value",
                           where, key, saved[key], current[key])
    scheduler.num_steps = 0
    scheduler.step(increment=int(saved["num_steps"]))
