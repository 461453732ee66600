"""Build the actor and the critic: Megatron-Core GPT/MoE models from a HuggingFace checkpoint.

megatron-bridge reads the HF config, maps it to a Megatron model provider and loads the weights;
this module only chooses the layer spec and fusions for the machine (Transformer Engine spec on
GPU when TE is installed, Megatron-Core's per-layer local spec otherwise:
`cpu_spec.cpu_block_spec`), applies the parallel layout and the recipe's architecture overrides,
turns the critic's LM head into a value head, and sets which parameter groups train.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_sao.config.schema import ModelConfig, RoleConfig, SaoConfig
from megatron_sao.config.validate import expert_tensor_size, sequence_parallel_enabled, validate_against_model
from megatron_sao.models.bridge_compat import have_transformer_engine, load_auto_bridge
from megatron_sao.models.param_groups import GroupCount, apply_trainable, format_param_table
from megatron_sao.models.value_head import ValueHead

logger = logging.getLogger(__name__)

Role = Literal["actor", "critic"]

# Recipe architecture overrides -> (HF config field for tiny checkpoints, Megatron provider field).
ARCH_OVERRIDES: dict[str, tuple[str, str]] = {
    "num_layers": ("num_hidden_layers", "num_layers"),
    "hidden_size": ("hidden_size", "hidden_size"),
    "num_attention_heads": ("num_attention_heads", "num_attention_heads"),
    "num_query_groups": ("num_key_value_heads", "num_query_groups"),
    "num_experts": ("num_experts", "num_moe_experts"),
    "moe_router_topk": ("num_experts_per_tok", "moe_router_topk"),
    "moe_ffn_hidden_size": ("moe_intermediate_size", "moe_ffn_hidden_size"),
}

_CPU_FUSIONS_OFF = (
    "gradient_accumulation_fusion", "persist_layer_norm", "bias_activation_fusion", "bias_dropout_fusion",
    "masked_softmax_fusion", "apply_rope_fusion", "cross_entropy_loss_fusion", "moe_grouped_gemm",
    "moe_permute_fusion",
)


@dataclass
class BuiltModel:
    """A role's model chunks (one per virtual pipeline stage held by this rank)."""

    role: Role
    chunks: list[torch.nn.Module]
    provider: Any
    param_counts: dict[str, GroupCount]


def arch_overrides(model: ModelConfig) -> dict[str, int]:
    return {k: v for k in ARCH_OVERRIDES if (v := getattr(model, k)) is not None}


def prepare_hf_checkpoint(model: ModelConfig, seed: int = 0) -> Path:
    """The HF checkpoint directory to start from; built (tiny, random) first if so configured."""
    if not model.hf_path:
        raise ValueError("model.hf_path is empty: set it to a HuggingFace checkpoint directory")
    path = Path(model.hf_path)
    if (path / "config.json").is_file():
        return path
    if not model.build_tiny:
        raise ValueError(f"model.hf_path={path}: no config.json there (not a HuggingFace checkpoint "
                         "directory); set model.build_tiny=true to build a tiny random one")
    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint

    hf_overrides = {ARCH_OVERRIDES[k][0]: v for k, v in arch_overrides(model).items()}
    logger.info("building tiny %s checkpoint at %s (%s)", model.tiny_family, path, hf_overrides)
    return build_tiny_hf_checkpoint(path, family=model.tiny_family, seed=seed, **hf_overrides)


# HF config field names of the architecture numbers the parallel layout must divide, per family.
_HF_ARCH_FIELDS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers",),
    "num_attention_heads": ("num_attention_heads",),
    "num_query_groups": ("num_key_value_heads",),
    "num_experts": ("num_experts", "n_routed_experts", "num_local_experts"),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
}


def model_architecture(config: SaoConfig) -> dict[str, int]:
    """Layers, heads, query groups, experts, expert FFN size of the model the config builds."""
    hf_path = prepare_hf_checkpoint(config.model, seed=config.run.seed)
    hf_config = json.loads((hf_path / "config.json").read_text())
    hf_config = {**hf_config, **hf_config.get("text_config", {})}
    arch = {}
    for key, names in _HF_ARCH_FIELDS.items():
        for name in names:
            if isinstance(hf_config.get(name), int):
                arch[key] = hf_config[name]
                break
    if not config.model.load_weights:
        arch.update(arch_overrides(config.model))
    return arch


def model_vocab_size(config: SaoConfig) -> int:
    """Rows of the model's token embedding (`vocab_size` of its config.json, or of the tiny model it
    builds): a token id must be below it. The checkpoint is built first when it is a tiny one."""
    from megatron_sao.models.hf_files import read_config

    hf_path = prepare_hf_checkpoint(config.model, seed=config.run.seed)
    hf_config = read_config(hf_path)
    value = {**hf_config, **(hf_config.get("text_config") or {})}.get("vocab_size")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{hf_path / 'config.json'}: field vocab_size is {value!r}, expected a positive integer")
    return value


def check_layout_fits_model(config: SaoConfig, source: str = "config") -> None:
    """Reject a parallel layout the model cannot be split into (heads / TP, experts / EP, layers / PP)
    before any process starts."""
    validate_against_model(config, model_architecture(config), source=source)


def _configure_provider(provider: Any, config: SaoConfig, routing_replay: bool = False) -> None:
    model, par = config.model, config.parallelism
    on_gpu = torch.cuda.is_available()
    # Megatron-Core's local layer spec without Transformer Engine: always on CPU, and on GPUs where
    # TE is not installed (slower kernels, same parameters; tools/gpu_check.sh runs so).
    local_spec = not on_gpu or not have_transformer_engine()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[model.dtype]
    if not on_gpu and dtype != torch.float32:
        warnings.warn(f"model.dtype={model.dtype} ignored on CPU: Megatron-Core runs in float32 here",
                      stacklevel=3)
        dtype = torch.float32
    provider.tensor_model_parallel_size = par.tensor
    provider.pipeline_model_parallel_size = par.pipeline
    provider.virtual_pipeline_model_parallel_size = par.virtual_pipeline
    provider.context_parallel_size = par.context
    if par.context > 1:
        provider.cp_comm_type = _cp_comm_type(provider, par.cp_comm_type)
    provider.expert_model_parallel_size = par.expert
    provider.expert_tensor_parallel_size = expert_tensor_size(config)
    provider.sequence_parallel = sequence_parallel_enabled(config)
    provider.params_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    provider.moe_token_dispatcher_type = model.moe_token_dispatcher
    provider.moe_aux_loss_coeff = model.moe_aux_loss_coeff
    provider.moe_grouped_gemm = model.moe_grouped_gemm and not local_spec
    # Losses are token sums; Megatron divides gradients by the token count summed over
    # micro-batches and DP ranks. DDP reads this when it is built (it then sums over DP instead of
    # averaging), so it is fixed here, not per step.
    provider.calculate_per_token_loss = True
    # Trajectories have different lengths; micro-batches are padded per length bucket, so
    # pipeline stages must exchange each micro-batch's shape before its activations.
    provider.variable_seq_lengths = par.pipeline > 1
    if model.recompute_granularity != "none":
        provider.recompute_granularity = model.recompute_granularity
        if model.recompute_granularity == "full":
            provider.recompute_method, provider.recompute_num_layers = "uniform", 1
    if local_spec:
        from megatron_sao.models.cpu_spec import cpu_block_spec

        provider.transformer_layer_spec = cpu_block_spec
        for name in _CPU_FUSIONS_OFF:  # each needs TE or Apex kernels
            setattr(provider, name, False)
    if not on_gpu:
        provider.use_cpu_initialization = True
        provider.autocast_dtype = None
    # Multi-token-prediction layers are not part of the models here (their HF tensors are carried
    # through by conversion, docs/conversion.md), but megatron-bridge 0.6.2 sets mtp_num_layers from
    # num_nextn_predict_layers (deepseek_v3_bridge.py, glm45_bridge.py) and builds them with the
    # Transformer Engine spec whatever the layer spec (gpt_provider.py `mtp_block_spec`): on CPU
    # the build fails, on GPUs it would add untrained layers with optimizer states.
    provider.mtp_num_layers = None
    if not model.load_weights:
        for key, value in arch_overrides(model).items():
            setattr(provider, ARCH_OVERRIDES[key][1], value)
    for key, value in model.provider_overrides.items():
        if not hasattr(provider, key):
            raise ValueError(f"model.provider_overrides.{key}: {type(provider).__name__} has no such attribute")
        setattr(provider, key, value)
    if routing_replay:
        # R3: every router owns a RouterReplay (megatron/core/transformer/moe/router.py); the TE-fused
        # top-k returns before consulting it (moe_utils.topk_routing_with_score_function).
        if model.provider_overrides.get("moe_router_fusion"):
            raise ValueError("model.provider_overrides.moe_router_fusion=true bypasses routing replay; drop it or "
                             "set actor.routing_replay=false")
        provider.moe_enable_routing_replay = True
        provider.moe_router_fusion = False
    provider.finalize()


def _cp_comm_type(provider: Any, configured: str | None) -> str:
    """Transformer Engine's CP exchange for `parallelism.cp_comm_type` (None: p2p; all_gather for
    DSA, whose `DSAttention` accepts nothing else: megatron-core 0.19.2 transformer_config.py)."""
    dsa = getattr(provider, "experimental_attention_variant", None) == "dsa"
    if dsa and configured not in (None, "all_gather"):
        raise ValueError(f"parallelism.cp_comm_type={configured}: the model's sparse attention (DSA) supports "
                         "context parallelism with all_gather only")
    return configured or ("all_gather" if dsa else "p2p")


def build_provider(config: SaoConfig, routing_replay: bool = False) -> tuple[Any, Any]:
    """(megatron-bridge AutoBridge, configured model provider) for `config.model`; with
    `routing_replay`, routers that can replay recorded expert choices (training/routing_replay.py)."""
    model = config.model
    if model.load_weights and arch_overrides(model) and not model.build_tiny:
        raise ValueError(
            f"model.{next(iter(arch_overrides(model)))} overrides the architecture of a checkpoint whose "
            "weights are loaded (model.load_weights=true): the shapes would not match"
        )
    hf_path = prepare_hf_checkpoint(model, seed=config.run.seed)
    check_layout_fits_model(config)
    bridge = load_auto_bridge(str(hf_path))
    provider = bridge.to_megatron_provider(load_weights=model.load_weights)
    _configure_provider(provider, config, routing_replay)
    return bridge, provider


def _role_config(config: SaoConfig, role: Role) -> RoleConfig:
    return config.actor if role == "actor" else config.critic


def build_model(config: SaoConfig, role: Role, wrap_with_ddp: bool = False, ddp_config: Any = None,
                routing_replay: bool = False) -> BuiltModel:
    """Build `role`'s model chunks on this rank (parallel state must be initialised); with
    `routing_replay` (the actor's R3) its routers can replay the engine's expert choices.

    The critic is the actor's trunk with `output_layer` replaced by a scalar `ValueHead` (after
    the HF weights are loaded, so the LM head is simply dropped). Which parameter groups train is
    applied before any DDP wrapping, so Megatron allocates gradient buffers only for those.
    """
    from megatron.core import parallel_state

    if not parallel_state.is_initialized():
        raise RuntimeError("Megatron parallel state is not initialised: call platform.init_model_parallel first")
    _, provider = build_provider(config, routing_replay)
    role_cfg = _role_config(config, role)
    counts: dict[str, GroupCount] = {}

    def attach_value_head(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        for chunk in chunks:
            if getattr(chunk, "post_process", False):
                chunk.output_layer = ValueHead(provider, init_std=config.critic.value_head_init_std,
                                               seed=config.run.seed)
        return chunks

    def set_trainable(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        counts.update(apply_trainable(chunks, role_cfg.trainable, role_cfg.frozen))
        return chunks

    if role == "critic":
        provider.register_pre_wrap_hook(attach_value_head)
    provider.register_pre_wrap_hook(set_trainable)
    on_gpu = torch.cuda.is_available()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        chunks = provider.provide_distributed_model(
            wrap_with_ddp=wrap_with_ddp, ddp_config=ddp_config, use_cpu_initialization=not on_gpu,
            bf16=provider.bf16, fp16=provider.fp16,
        )
    if config.logging.param_table and torch.distributed.get_rank() == 0:
        logger.info("\n%s", format_param_table(role, counts))
    return BuiltModel(role=role, chunks=list(chunks), provider=provider, param_counts=counts)
