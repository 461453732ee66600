"""Actor and critic construction (megatron-bridge providers), value head, parameter groups, and the
tiny HF checkpoints of tests and the demo (`tiny_hf`).

The names load on first use: a program that needs only `tiny_hf` (test helpers, tools, `sao plan`
on a tiny family) does not pay for megatron-bridge (`build`), which takes several seconds to import.
"""

from __future__ import annotations

from megatron_sao.utils.lazy_exports import lazy_getattr

_EXPORTS = {
    "BuiltModel": "build",
    "build_model": "build",
    "build_provider": "build",
    "prepare_hf_checkpoint": "build",
    "GROUPS": "param_groups",
    "apply_trainable": "param_groups",
    "format_param_table": "param_groups",
    "param_group": "param_groups",
    "ValueHead": "value_head",
}

__all__ = [
    "GROUPS",
    "BuiltModel",
    "ValueHead",
    "apply_trainable",
    "build_model",
    "build_provider",
    "format_param_table",
    "param_group",
    "prepare_hf_checkpoint",
]

__getattr__ = lazy_getattr(__name__, _EXPORTS)
