"""Actor and critic construction (megatron-bridge providers), value head, parameter groups."""

from megatron_sao.models.build import BuiltModel, build_model, build_provider, prepare_hf_checkpoint
from megatron_sao.models.param_groups import GROUPS, apply_trainable, format_param_table, param_group
from megatron_sao.models.value_head import ValueHead

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
