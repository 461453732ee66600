"""The optimizer part of a training checkpoint, in a form that loads into any layout.

Megatron's optimizer state dict has two parts. The tensors (Adam moments and fp32 main params)
are ShardedTensors keyed by the model parameter's key: with the distributed optimizer stored
`fully_reshardable` and with the plain optimizer alike, they reshard across TP/PP/EP/DP. The
rest (param groups, their hyperparameters and step) is nested by how the optimizer is chained:
with EP > 1 dense and expert parameters get separate optimizers, with EP = 1 one, so the
structure saved at EP2 does not fit a DP2 optimizer. On load we therefore keep the current
optimizer's own structure and hyperparameters (the run's config, as for the LR scheduler) and
take only the tensors and the Adam step count from the checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_sao.training.checkpoint import compat

DIST_OPTIM_FORMAT = "fully_reshardable"
PLAIN_OPTIM_FORMAT = "plain"
_SHARDED = object()  # marks a slot filled from the checkpoint in a skeleton


def optimizer_metadata() -> dict[str, Any]:
    """How Megatron builds the optimizer's sharded state. `fully_reshardable` gathers each DP group's
    shards before writing: over NCCL on GPU (every DP rank then writes a share), over the gloo DP
    group on CPU (`mem_efficient`: gathered on DP rank 0 only; the NCCL path calls `.cuda()`).
    Both variants load into each other."""
    return {"distrib_optim_sharding_type": DIST_OPTIM_FORMAT, "chained_optim_avoid_prefix": True,
            "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available()}


def optimizer_format(optimizer: Any) -> str:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    return DIST_OPTIM_FORMAT if any(isinstance(o, DistributedOptimizer) for o in inners) else PLAIN_OPTIM_FORMAT


def sharded_optimizer_state(optimizer: Any, model_state: dict[str, Any], is_loading: bool) -> dict[str, Any]:
    # A never-stepped optimizer (the actor during critic warmup, or before a load) has no Adam
    # state and Megatron's `state_dict()` asserts on it: give it the zero state with step 0 that
    # Adam's first step would create (so training continues bit for bit as without the save).
    compat.prime_for_loading(optimizer)
    return optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=optimizer_metadata())


def skeleton(tree: Any) -> Any:
    """`tree` with every checkpoint-backed leaf replaced by a marker and plain values copied
    (taken before `dist_checkpointing.load`, which rewrites the state dict it is given)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    if isinstance(tree, (ShardedBase, LocalNonpersistentObject)):
        return _SHARDED
    if isinstance(tree, dict):
        return {k: skeleton(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [skeleton(v) for v in tree]
    return tree


def _fill(skel: Any, loaded: Any) -> Any:
    """The skeleton with its markers replaced by the loaded values at the same paths."""
    if skel is _SHARDED:
        if loaded is None:
            raise ValueError("optimizer tensor missing from the checkpoint")
        return loaded
    if isinstance(skel, dict):
        return {k: _fill(v, loaded.get(k) if isinstance(loaded, dict) else None) for k, v in skel.items()}
    if isinstance(skel, list):
        present = isinstance(loaded, list)
        return [_fill(v, loaded[i] if present and i < len(loaded) else None) for i, v in enumerate(skel)]
    return skel


def _saved_steps(tree: Any, out: set[float]) -> set[float]:
    """Adam step counts anywhere in the checkpoint's optimizer state (param groups' `step`, or the
    plain optimizer's `common_step`)."""
    if isinstance(tree, dict):
        for group in tree.get("param_groups", []) if isinstance(tree.get("param_groups"), list) else []:
            if isinstance(group, dict) and "step" in group:
                out.add(float(group["step"]))
        if "common_step" in tree:
            out.add(float(torch.as_tensor(tree["common_step"])))
        for v in tree.values():
            _saved_steps(v, out)
    elif isinstance(tree, list):
        for v in tree:
            _saved_steps(v, out)
    return out


def _set_steps(tree: Any, step: float, plain: bool) -> None:
    if isinstance(tree, dict):
        if isinstance(tree.get("param_groups"), list):
            if plain:
                tree.setdefault("state", {})["common_step"] = torch.tensor(step)
            else:
                for group in tree["param_groups"]:
                    group["step"] = type(group["step"])(step) if "step" in group else step
        for v in tree.values():
            _set_steps(v, step, plain)
    elif isinstance(tree, list):
        for v in tree:
            _set_steps(v, step, plain)


def load_optimizer_state(optimizer: Any, skel: Any, loaded: Any, where: str) -> None:
    """Load the checkpoint's tensors (`loaded`, at the paths of the current structure) and Adam step into
    `optimizer`, keeping its own param-group structure and hyperparameters (`skel`)."""
    steps = _saved_steps(loaded, set())
    if len(steps) > 1:
        raise ValueError(f"{where}: optimizer state records different Adam steps {sorted(steps)}")
    state = _fill(skel, loaded)
    if steps:
        _set_steps(state, steps.pop(), plain=optimizer_format(optimizer) == PLAIN_OPTIM_FORMAT)
    compat.tolerate_missing_step()
    with torch.no_grad():  # fp32 main params of the distributed optimizer are views of the weights
        optimizer.load_state_dict(state)
    compat.unshare_steps(optimizer)
