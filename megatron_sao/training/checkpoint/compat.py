"""Three fixes that make Megatron-Core 0.19.2's distributed-optimizer checkpoint load exact when the
inner optimizer is torch's Adam (no Apex / Transformer Engine: CPU hosts, and GPU hosts without
them). With TE/Apex FusedAdam, `step` lives in the param groups and none of this applies; each
function checks `HAVE_APEX_OR_TE` and does nothing then. Each is exercised by
tests/training/test_checkpoint.py (exact resume with the distributed optimizer).

1. `prime_for_loading`: building the load state dict calls `DistributedOptimizer.state_dict()`,
   which asserts one common per-parameter `step`; a never-stepped optimizer has none.
2. `tolerate_missing_step`: `load_parameter_state_from_fully_reshardable` drops `step` from the
   loaded tensors, then `_set_main_param_and_optimizer_states` looks it up for every state key
   (KeyError). The step was already restored from the param groups; keep it.
3. `unshare_steps`: `DistributedOptimizer.load_state_dict` gives every parameter the SAME `step`
   tensor object, and torch keeps it shared; Adam then increments it once per parameter per step,
   so bias correction after resume would be wrong. Give each parameter its own copy.
"""

from __future__ import annotations

from typing import Any

import torch

_PATCHED: list[str] = []


def _without_te() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _dist_optimizers(optimizer: Any) -> list[Any]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in inners if isinstance(o, DistributedOptimizer)]


def prime_for_loading(optimizer: Any) -> None:
    """Zero Adam state with step 0 in never-stepped distributed optimizers: what Adam's first step
    creates anyway, so saving one (critic warmup) or loading into one changes nothing else."""
    if not _without_te():
        return
    for inner in _dist_optimizers(optimizer):
        if inner.optimizer.state:
            continue
        inner.init_state_fn(inner.optimizer, inner.config)
        for state in inner.optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))


def tolerate_missing_step() -> None:
    """Patch `_set_main_param_and_optimizer_states` to keep the current `step` when the loaded tensors
    lack it (once per process; only without TE/Apex)."""
    if not _without_te() or "tolerate_missing_step" in _PATCHED:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if isinstance(step, torch.Tensor):
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states  # type: ignore[method-assign]
    _PATCHED.append("tolerate_missing_step")


def unshare_steps(optimizer: Any) -> None:
    """Give every parameter's Adam state its own `step` tensor after a load."""
    if not _without_te():
        return
    for inner in _dist_optimizers(optimizer):
        for state in inner.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
