"""Small, named compatibility shims that let Megatron-Core run on a CPU-only machine (gloo).

Megatron-Core is written for CUDA: a few code paths call CUDA-only APIs even when the model
itself is on CPU. Each shim below replaces exactly one such call site, says which Megatron code
needs it, and is applied only when CUDA is absent (`apply_cpu_shims`), so GPU runs execute
Megatron-Core unmodified. Checked against megatron-core 0.19.2. Each shim has a test in
tests/platform/test_cpu_shims.py showing the failure it prevents is gone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

_APPLIED: list[str] = []


def _shim_current_device() -> None:
    """`torch.cuda.current_device()` is called while building modules and buffers (e.g. MoE
    token dispatchers, `get_cuda_rng_tracker` users); on CPU it raises. Return "cpu"."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _shim_cuda_device_factories() -> None:
    """Tensor factories with a hard-coded device="cuda" (pipeline schedules' `total_num_tokens`,
    `transformer.utils.get_default_causal_mask`) are redirected to CPU by a global
    TorchFunctionMode; `torch.cuda.synchronize` (p2p communication) becomes a no-op."""
    from torch.overrides import TorchFunctionMode

    class CudaDeviceToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            device = kwargs.get("device")
            if device is not None and str(device).startswith("cuda"):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    mode = CudaDeviceToCpu()
    mode.__enter__()  # stays active for the life of the process
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


def _shim_sequence_parallel_torch_norm() -> None:
    """Without Transformer Engine or Apex the local layer spec builds norms through
    `WrappedTorchNorm`, which asserts `not config.sequence_parallel`; but MoE with TP > 1 requires
    sequence parallelism. Build the same torch norm and tag its parameters `sequence_parallel`
    as TE's norms do, so their gradients are all-reduced across the TP group."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__new__

    def sequence_parallel_new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(sequence_parallel_new)  # type: ignore[method-assign]


def _shim_dispatcher_streams() -> None:
    """The alltoall MoE token dispatcher creates `torch.cuda.Stream()`s and events for its
    device-to-host copies of split sizes; on CPU use inert stand-ins. Its
    `maybe_move_tensor_to_cpu(as_numpy=True)` also skips CPU tensors, leaving the split sizes as
    tensors that gloo's all_to_all_single rejects: convert them as the CUDA path would."""

    class InertEvent:
        def synchronize(self) -> None: ...

        def wait(self, *args: Any, **kwargs: Any) -> None: ...

        def record(self, *args: Any, **kwargs: Any) -> None: ...

        def query(self) -> bool:
            return True

    class InertStream(InertEvent):
        def __new__(cls, *args: Any, **kwargs: Any):  # a class, so `torch.cuda.Stream | None` works
            return _STREAM

        def wait_stream(self, *args: Any, **kwargs: Any) -> None: ...

        def wait_event(self, *args: Any, **kwargs: Any) -> None: ...

        def record_event(self, *args: Any, **kwargs: Any) -> InertEvent:
            return InertEvent()

    _STREAM = object.__new__(InertStream)
    torch.cuda.Stream = InertStream  # type: ignore[misc,assignment]
    torch.cuda.Event = InertEvent  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda *a, **k: _STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]

    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    def to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


def _shim_grad_clip() -> None:
    """`clip_grad_by_total_norm_fp32` asserts grads are `torch.cuda.FloatTensor` and scales them
    with a multi-tensor kernel on a CUDA overflow buffer. Same arithmetic, on CPU tensors."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for param in parameters:
                grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
                if grad is not None:
                    grad.detach().mul_(clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _shim_distributed_optimizer_param_types() -> None:
    """`DistributedOptimizer._build_model_and_main_param_groups` accepts only parameters whose
    `.type()` is `torch.cuda.{Float,Half,BFloat16}Tensor`. While that one method runs, report
    CPU tensor types under their CUDA names."""
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls._build_model_and_main_param_groups.__func__

    def build_groups(klass, *args, **kwargs):
        original_type = torch.Tensor.type

        def cuda_named_type(self, *type_args, **type_kwargs):
            name = original_type(self, *type_args, **type_kwargs)
            if not type_args and not type_kwargs and isinstance(name, str) and ".cuda." not in name:
                name = name.replace("torch.", "torch.cuda.", 1)
            return name

        torch.Tensor.type = cuda_named_type  # type: ignore[method-assign]
        try:
            return original(klass, *args, **kwargs)
        finally:
            torch.Tensor.type = original_type  # type: ignore[method-assign]

    cls._build_model_and_main_param_groups = classmethod(build_groups)


def _shim_pos_emb_on_this_cp_rank() -> None:
    """Under context parallelism the rotary embeddings are cut to this rank's two sequence chunks
    by `rope_utils.get_pos_emb_on_this_cp_rank`, which builds its index with `pin_memory=True`
    and `.cuda()`. The same slicing with the index on the embedding's device; replaced where the
    rotary modules imported it by name."""
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary_pos_embedding
    import megatron.core.models.common.embeddings.yarn_rotary_pos_embedding as yarn_rotary_pos_embedding

    def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, index)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


def _shim_cuda_rng_state() -> None:
    """Activation recomputation (`model.recompute_granularity` full or selective) runs through
    `tensor_parallel.CheckpointFunction`, which saves the CPU and CUDA RNG states with each
    checkpoint and restores them for the recomputation (`random._get_all_rng_states` /
    `_set_all_rng_states`); the CUDA one does not exist on CPU. The CPU state is still saved and
    restored; the CUDA state is an empty placeholder."""
    import megatron.core.tensor_parallel.random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None


CPU_SHIMS: dict[str, Callable[[], None]] = {
    "current_device": _shim_current_device,
    "cuda_device_factories": _shim_cuda_device_factories,
    "sequence_parallel_torch_norm": _shim_sequence_parallel_torch_norm,
    "dispatcher_streams": _shim_dispatcher_streams,
    "grad_clip": _shim_grad_clip,
    "distributed_optimizer_param_types": _shim_distributed_optimizer_param_types,
    "pos_emb_on_this_cp_rank": _shim_pos_emb_on_this_cp_rank,
    "cuda_rng_state": _shim_cuda_rng_state,
}


def applied_cpu_shims() -> list[str]:
    return list(_APPLIED)


def apply_cpu_shims(force: bool = False) -> list[str]:
    """Apply every CPU shim once per process, only when CUDA is absent (or `force`).

    Returns the names applied by this call. Idempotent.
    """
    if torch.cuda.is_available() and not force:
        return []
    newly = []
    for name, shim in CPU_SHIMS.items():
        if name in _APPLIED:
            continue
        shim()
        _APPLIED.append(name)
        newly.append(name)
    if newly:
        logger.info("applied Megatron-Core CPU shims: %s", ", ".join(newly))
    return newly
