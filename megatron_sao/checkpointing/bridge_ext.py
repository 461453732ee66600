"""megatron-bridge as conversion uses it: the AutoBridge of a checkpoint, with local-spec expert names.

`models.bridge_compat.load_auto_bridge` already bridges the Transformer Engine norm names to the
local (CPU) spec's. Some family bridges (GLM-4.5 in megatron-bridge 0.6.2) also name routed
experts only in the grouped-GEMM form (`mlp.experts.linear_fc1.weight<E>`), while the local spec
builds `SequentialMLP` (`mlp.experts.local_experts.<E>.linear_fc1.weight`). Without an alias those
experts have no mapping and the bridge skips them with a log line: the silent expert drop this
project must not have. `open_bridge` adds the local alias (same HF tensors, same mapping type)
when Transformer Engine is absent, for every bridge class that lacks it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from megatron_sao.models.bridge_compat import have_transformer_engine, load_auto_bridge

# grouped-GEMM expert parameter pattern -> SequentialMLP (local spec) pattern; the expert number is
# the second wildcard in both, so the HF side of the mapping is unchanged.
_GROUPED_TO_LOCAL = re.compile(r"^(?P<head>.*\.mlp\.experts)\.(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)\*$")


def _local_expert_alias(mapping: Any) -> Any | None:
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping

    match = _GROUPED_TO_LOCAL.match(mapping.megatron_param)
    if match is None:
        return None
    local = f"{match['head']}.local_experts.*.{match['fc']}.{match['kind']}"
    if type(mapping) is GatedMLPMapping:
        return GatedMLPMapping(megatron_param=local, gate=mapping.hf_param["gate"], up=mapping.hf_param["up"])
    if type(mapping) is AutoMapping and isinstance(mapping.hf_param, str):
        return AutoMapping(megatron_param=local, hf_param=mapping.hf_param)
    raise NotImplementedError(
        f"no local-spec alias for expert mapping {type(mapping).__name__}({mapping.megatron_param}): "
        "issue 4, docs/conversion.md#families"
    )


def _add_local_expert_aliases(bridge_cls: type) -> None:
    if getattr(bridge_cls, "_sao_local_expert_aliases", False):
        return
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

    original = bridge_cls.mapping_registry

    def mapping_registry(self):
        registry = original(self)
        names = {m.megatron_param for m in registry.mappings}
        aliases = []
        for mapping in registry.mappings:
            alias = _local_expert_alias(mapping)
            if alias is not None and alias.megatron_param not in names:
                aliases.append(alias)
                names.add(alias.megatron_param)
        return MegatronMappingRegistry(*registry.mappings, *aliases)

    bridge_cls.mapping_registry = mapping_registry
    bridge_cls._sao_local_expert_aliases = True


def open_bridge(hf_dir: str | Path) -> Any:
    """The megatron-bridge AutoBridge for the (causal-LM) HF directory `hf_dir`; weights stay lazy."""
    bridge = load_auto_bridge(str(hf_dir))
    if not have_transformer_engine():
        from megatron.bridge.models.conversion.param_mapping import AutoMapping

        # cpu_spec.DuplicatedLinear (the DSA indexer's projections) is replicated over TP ranks.
        AutoMapping.register_module_type("DuplicatedLinear", "replicated")
        _add_local_expert_aliases(type(bridge._model_bridge))
    return bridge
