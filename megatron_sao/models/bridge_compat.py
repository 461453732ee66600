"""Importing and using megatron-bridge on machines without Transformer Engine.

megatron-bridge (0.6.x) imports `transformer_engine.pytorch` unconditionally in a few modules,
and its weight mappings name modules as the Transformer Engine specs build them, while the local
(non-TE) layer spec, the only one that runs on CPU, differs in three ways:
- norms fused into the following linear under TE (`linear_qkv.layer_norm_weight`) are separate
  modules (`input_layernorm.weight`);
- some family bridges (GLM-4.5) name routed experts only in the grouped-GEMM form
  (`mlp.experts.linear_fc1.weight<E>`) while the local spec builds `SequentialMLP`
  (`mlp.experts.local_experts.<E>.linear_fc1.weight`); without an alias those experts have no
  mapping and the bridge skips them with only a log line, the silent expert drop this project
  must not have;
- the DSA indexer's replicated projections are `cpu_spec.DuplicatedLinear`, a module type the
  bridge must be told is TP-replicated.
All three are bridged here, only when TE is absent; with TE installed megatron-bridge is used
unmodified.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any

# TE fused-norm parameter name -> the local spec's separate norm module parameter.
LOCAL_SPEC_NORM_ALIASES: dict[str, str] = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
    ".self_attention.linear_q_up_proj.layer_norm_weight": ".self_attention.q_layernorm.weight",
    ".self_attention.linear_kv_up_proj.layer_norm_weight": ".self_attention.kv_layernorm.weight",
}


@cache
def have_transformer_engine() -> bool:
    """Whether the real Transformer Engine is installed (decided before any stub is put in place)."""
    if getattr(sys.modules.get("transformer_engine"), "_sao_stub", False):
        return False
    return importlib.util.find_spec("transformer_engine") is not None


class _UnavailableMeta(type):
    """Any attribute of a stubbed TE symbol is another stub (`te.ops.Sequential` in annotations);
    constructing one raises; nothing is an instance of one."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(f"{cls.__name__}.{name}")

    def __instancecheck__(cls, obj: Any) -> bool:
        return False


def _unavailable(qualname: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{qualname} needs Transformer Engine, which is not installed "
                           "(GPU extra: see launchers/container/)")

    return _UnavailableMeta(qualname, (), {"__init__": __init__})


class _TEStubModule(types.ModuleType):
    """Stands in for `transformer_engine` so megatron-bridge imports; any use raises."""

    _sao_stub = True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in ("pytorch", "common"):
            sub = _TEStubModule(f"{self.__name__}.{name}")
            sub.__path__ = []
            sys.modules[sub.__name__] = sub
            setattr(self, name, sub)
            return sub
        return _unavailable(f"{self.__name__}.{name}")


def _install_te_stub() -> None:
    # Megatron-Core's own `try: import transformer_engine` probes must conclude HAVE_TE=False
    # before the stub exists, so import them first.
    import megatron.core.extensions
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.transformer.moe.moe_utils  # noqa: F401

    root = _TEStubModule("transformer_engine")
    root.__path__ = []
    root.__version__ = "0.0.0+sao-stub"
    sys.modules["transformer_engine"] = root
    root.pytorch  # noqa: B018 - registers the submodules
    root.common  # noqa: B018
    root.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", loader=None, is_package=True)


@cache
def import_auto_bridge() -> type:
    """`megatron.bridge.AutoBridge`, importable with or without Transformer Engine."""
    if not have_transformer_engine():
        _install_te_stub()
    from megatron.bridge import AutoBridge

    return AutoBridge


def _add_local_spec_aliases(bridge_cls: type) -> None:
    if getattr(bridge_cls, "_sao_local_aliases", False):
        return
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    original = bridge_cls.mapping_registry

    def mapping_registry(self):
        registry = original(self)
        aliases = []
        for mapping in registry.mappings:
            for te_suffix, local_suffix in LOCAL_SPEC_NORM_ALIASES.items():
                if mapping.megatron_param.endswith(te_suffix) and isinstance(mapping.hf_param, str):
                    local_name = mapping.megatron_param[: -len(te_suffix)] + local_suffix
                    aliases.append(AutoMapping(megatron_param=local_name, hf_param=mapping.hf_param))
        return MegatronMappingRegistry(*registry.mappings, *aliases)

    bridge_cls.mapping_registry = mapping_registry
    bridge_cls._sao_local_aliases = True


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


def load_auto_bridge(hf_path: str | Path, dtype: Any = None):
    """An AutoBridge for the HF checkpoint at `hf_path` (weights stay lazy), with the local-spec
    names above when TE is absent."""
    auto_bridge_cls = import_auto_bridge()
    kwargs = {"torch_dtype": dtype} if dtype is not None else {}
    bridge = auto_bridge_cls.from_hf_pretrained(str(hf_path), **kwargs)
    if not have_transformer_engine():
        from megatron.bridge.models.conversion.param_mapping import AutoMapping

        AutoMapping.register_module_type("DuplicatedLinear", "replicated")
        bridge_cls = type(bridge._model_bridge)
        _add_local_spec_aliases(bridge_cls)
        _add_local_expert_aliases(bridge_cls)
    return bridge
