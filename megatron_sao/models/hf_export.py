"""Megatron -> HuggingFace weight stream: the one place that turns live Megatron chunks into
HF-named full tensors, used by weight sync into rollout engines and by `sao convert mcore-to-hf`.

megatron-bridge does the work (`stream_weights_megatron_to_hf`): per HF tensor it gathers the
Megatron shards across TP / PP / EP / ETP and converts names and layouts (QKV split, gate / up
split, expert unstacking). It is collective: every rank of the model must run the stream to the
end, in the same order, and every rank receives every full tensor. This module adds what both
callers need on top:

- a critic (`role="critic"`): the bridge knows causal LMs only, so the trunk streams from a
  causal-LM view of the checkpoint directory without the LM-head task, and the value head is
  appended as `score.weight` / `score.bias` (the critic HF format, `models.critic_format`);
- an optional cast of floating tensors (`dtype`, e.g. bfloat16 for engines after fp32 training);
- buckets (`HFWeightExporter.buckets`): consecutive tensors grouped up to a byte budget, built on
  rank 0 only, so that rank 0 holds at most one bucket (plus the bridge's current tensor) while it
  hands buckets to engines; the other ranks take part in the gathers and keep nothing.

- owned shares (`HFWeightExporter.stream_owned`): the stream without the expert-parallel gathers.
  Each rank yields every non-expert tensor (full, as above) and only its own experts (after any
  expert-TP gather), and exactly one rank of the model is marked the owner of each HF tensor, so
  the ranks can write (or send) the model in parallel, each its share, and no expert crosses the
  EP group: `sao convert mcore-to-hf` writes this way.

Memory: the bridge materialises each full tensor on every rank (its all-gathers end on all
ranks), one tensor at a time; the largest single tensor (an embedding, or one stacked expert
projection) bounds the extra memory per rank.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from megatron_sao.models import critic_format as cf
from megatron_sao.models.bridge_compat import load_auto_bridge

Role = Literal["actor", "critic"]


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _local_param(task: Any) -> torch.Tensor | None:
    if task is not None and task.megatron_module is not None and isinstance(task.param_weight, torch.Tensor):
        return task.param_weight
    return None


# `maybe_modify_converted_hf_weight` overrides read that only add to the current task's tensors
# (DeepSeek-V3: the source's rotary inv_freq next to each layer's input norm); round trips with
# parameters given back as exported are bit-exact through them (tests/checkpointing/test_roundtrip.py).
_OVERRIDES_HOLDING_NOTHING = frozenset({"DeepSeekV3Bridge.maybe_modify_converted_hf_weight"})


_LAYER = re.compile(r"layers\.\d+")


def in_model_order(tasks: list[Any]) -> list[Any]:
    """megatron-bridge's conversion tasks (sorted by layer, the parameters outside any layer first:
    embedding, final norm, output layer) in the model's module order instead: embedding, the layers
    in the bridge's order, everything else. A load reads a checkpoint in about that order (Megatron
    saves in module order), so an export that waits for each parameter (`_task_loop`) starts as
    soon as the embedding is in, not once the final norm at the end of a file is. Decided on names
    alone, hence the same on every rank (pipeline stages broadcast task by task)."""

    def place(task: Any) -> int:
        name = getattr(task, "global_param_name", "")
        if _LAYER.search(name):
            return 1
        return 0 if name.startswith("embedding.") else 2

    return sorted(tasks, key=place)  # stable: the bridge's order within each group


def _task_loop(wait_for: Callable[[torch.Tensor], None] | None,
               on_exported: Callable[[torch.Tensor], None] | None) -> Callable[..., Iterator[Any]]:
    """megatron-bridge's task-loop wrapper, replaced: wait for each task's local parameter first
    (`wait_for`), and report each one once its last task is behind (`on_exported`): the bridge
    asks for the next task only after it yielded every HF tensor of the previous one (unless it
    holds them across tasks: `HFWeightExporter.reports_exported`), and the consumer has handled
    each before the stream resumes."""

    def storage(param: torch.Tensor) -> int:
        # tasks reading views of one storage (e.g. one expert each of a grouped weight) count together
        return param.untyped_storage().data_ptr()

    def tasks_in_order(tasks: list[Any], description: str, show_progress: bool = True) -> Iterator[Any]:
        tasks = in_model_order(tasks)
        remaining: dict[int, int] = {}
        for task in tasks:
            if (param := _local_param(task)) is not None:
                remaining[storage(param)] = remaining.get(storage(param), 0) + 1
        previous = None
        for task in [*tasks, None]:
            if previous is not None and on_exported is not None:
                remaining[storage(previous)] -= 1
                if remaining[storage(previous)] == 0:
                    on_exported(previous)
            if task is None:
                return
            previous = _local_param(task)
            if previous is not None and wait_for is not None:
                wait_for(previous)
            yield task

    return tasks_in_order


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class OwnedTensor(NamedTuple):
    name: str
    tensor: torch.Tensor
    owned: bool
    """This rank is the one rank of the model that keeps this tensor (writes it, sends it)."""
    expert_local: bool
    """An expert of this rank's expert-parallel slice: at the same step every other EP rank yields
    its own expert in this one's place (so the model's bytes at this step are EP x this one's)."""


def _skip_expert_gather(mapping: Any, names: set[str]) -> None:
    """Replace the mapping's `gather_from_ep_ranks` (and that of an `AutoMapping`'s delegate, made
    on first use) with one that returns this rank's own expert under its global HF name (the task's
    name already carries the global expert number), without a collective; `names` collects them."""

    def own_expert(weights: torch.Tensor, module: Any, hf_param_name: str) -> dict[str, torch.Tensor]:
        names.add(str(hf_param_name))
        return {str(hf_param_name): weights}

    mapping.gather_from_ep_ranks = own_expert
    make_delegate = getattr(mapping, "_get_or_create_mapping", None)
    if make_delegate is not None:
        def patched_delegate(parallelism_type: str) -> Any:
            delegate = make_delegate(parallelism_type)
            _skip_expert_gather(delegate, names)
            return delegate

        mapping._get_or_create_mapping = patched_delegate
        if getattr(mapping, "_mapping", None) is not None:
            _skip_expert_gather(mapping._mapping, names)


class _Owners:
    """Who keeps each tensor of `stream_owned`: an expert, the lowest global rank of its EP rank's
    replicas (pipeline stages, expert-TP and expert-DP ranks all hold the same experts); any other
    tensor, the rank with the fewest such bytes so far (every rank sees the same sequence, so every
    rank computes the same owner without talking)."""

    def __init__(self, expert_parallel_rank: int) -> None:
        self.rank, self.world = _rank(), 1
        peers = [expert_parallel_rank]
        if torch.distributed.is_initialized():
            self.world = torch.distributed.get_world_size()
            peers = [None] * self.world
            torch.distributed.all_gather_object(peers, expert_parallel_rank)
        self.expert_owner = min(r for r, ep in enumerate(peers) if ep == expert_parallel_rank)
        self.loads = [0] * self.world

    def owns_shared(self, nbytes: int) -> bool:
        owner = min(range(self.world), key=lambda r: (self.loads[r], r))
        self.loads[owner] += nbytes
        return owner == self.rank


class HFWeightExporter:
    """Streams `chunks` (this rank's model chunks, DDP-wrapped or not, any parallel layout) as HF
    tensors named after the checkpoint at `hf_dir` (its config decides the mapping; its weights
    are not read). Build once per model; every call of `stream` / `buckets` is one export of the
    chunks' current values and is collective over all ranks of the model."""

    def __init__(self, chunks: Sequence[torch.nn.Module], hf_dir: str | Path, role: Role = "actor",
                 dtype: torch.dtype | None = None) -> None:
        self._view_root: Path | None = None
        if role not in ("actor", "critic"):
            raise ValueError(f"role must be 'actor' or 'critic', got {role!r}")
        hf_dir = Path(hf_dir)
        if not (hf_dir / "config.json").is_file():
            raise ValueError(f"{hf_dir}: no config.json (the HF checkpoint directory the model was built from)")
        self.chunks = list(chunks)
        self.hf_dir = hf_dir
        """The directory as given (config, tokenizer: what an engine needs next to the weights)."""
        self.role = role
        self.dtype = dtype
        config = json.loads((hf_dir / "config.json").read_text())
        if cf.is_critic_config(config):  # megatron-bridge accepts causal LMs only
            self._view_root = Path(tempfile.mkdtemp(prefix="sao-hf-export-view-"))
            hf_dir = cf.causal_view(hf_dir, config, self._view_root / "hf")
        self.bridge = load_auto_bridge(hf_dir)

    def close(self) -> None:
        if self._view_root is not None:
            shutil.rmtree(self._view_root, ignore_errors=True)
            self._view_root = None

    def __del__(self) -> None:
        self.close()

    # ---- the stream --------------------------------------------------------------------------

    def stream(self, cpu: bool = True,
               wait_for: Callable[[torch.Tensor], None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: `(hf_name, full_tensor)` for every HF tensor, the same on every rank. With
        `cpu=False` tensors stay on the model's device (for CUDA-IPC engine payloads). `wait_for`
        is called with each local parameter before it is read (a load still filling the chunks:
        `sao convert mcore-to-hf`); it must return on every rank, or the gathers hang."""
        for name, tensor, _ in self._stream(cpu, wait_for, gather_experts=True, copy_live=True):
            yield name, tensor

    def reports_exported(self) -> bool:
        """Whether `stream_owned` can report each parameter once exported (`on_exported`): not where
        megatron-bridge may keep a task's HF tensors (possibly views of its parameter) until a later
        task. Grouped expert exports stack all experts of a layer first, and a model bridge that
        overrides `maybe_modify_converted_hf_weight` may merge experts the same way."""
        from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

        model_bridge = self.bridge._model_bridge
        override = type(model_bridge).maybe_modify_converted_hf_weight
        if (override is not MegatronModelBridge.maybe_modify_converted_hf_weight
                and override.__qualname__ not in _OVERRIDES_HOLDING_NOTHING):
            return False
        mappings = model_bridge.mapping_registry().get_all_mappings()
        return not any(getattr(m, "is_grouped_export", False) for m in mappings)

    def stream_owned(self, cpu: bool = True, wait_for: Callable[[torch.Tensor], None] | None = None,
                     may_alias: bool = False,
                     on_exported: Callable[[torch.Tensor], None] | None = None) -> Iterator[OwnedTensor]:
        """Collective: like `stream`, but experts are not gathered across expert-parallel ranks:
        each rank yields its own (see `OwnedTensor`), and every HF tensor of the model is `owned`
        by exactly one rank. Fused-expert HF formats (one tensor for all experts of a layer) still
        gather, and are then owned like any shared tensor. With `may_alias`, a tensor may be (a view
        of) a live parameter instead of a copy: for a consumer done with it before the model
        changes (a conversion writing it out), which then saves a copy of every local expert.
        `on_exported(parameter)` is called once every HF tensor made from a local parameter (and
        from anything else in its storage) has been yielded and handled (the consumer asked for the
        next one), so a consumer done with the model may free it; only where `reports_exported()`
        (ValueError otherwise)."""
        from megatron.core import parallel_state

        if on_exported is not None and not self.reports_exported():
            raise ValueError(f"{self.hf_dir}: megatron-bridge may hold exported tensors across tasks for this model "
                             "(grouped expert export): parameters cannot be reported as exported")
        owners = _Owners(parallel_state.get_expert_model_parallel_rank())
        for name, tensor, expert_local in self._stream(cpu, wait_for, gather_experts=False, copy_live=not may_alias,
                                                       on_exported=on_exported):
            owned = owners.rank == owners.expert_owner if expert_local else owners.owns_shared(tensor_nbytes(tensor))
            yield OwnedTensor(name, tensor, owned, expert_local)

    def _stream(self, cpu: bool, wait_for: Callable[[torch.Tensor], None] | None, gather_experts: bool,
                copy_live: bool, on_exported: Callable[[torch.Tensor], None] | None = None,
                ) -> Iterator[tuple[str, torch.Tensor, bool]]:
        """(name, tensor, expert_local): see `stream` and `stream_owned`."""
        model_bridge = self.bridge._model_bridge
        hf_config = self.bridge.hf_pretrained.config
        tasks = None
        if self.role == "critic" or not gather_experts:
            unwrapped = [_unwrap(c) for c in self.chunks]
            tasks = model_bridge.build_conversion_tasks(hf_config, unwrapped)
        if self.role == "critic":  # the critic's output layer is the value head, not an LM head
            tasks = [t for t in tasks if t is None or not t.global_param_name.startswith("output_layer.")]
        expert_names: set[str] = set()
        if not gather_experts:
            for task in tasks:
                mapping = task.mapping if task is not None else None
                if (mapping is not None and mapping.is_expert and mapping.ep_size > 1
                        and not getattr(mapping, "is_grouped_export", False)):
                    _skip_expert_gather(mapping, expert_names)
        # A tensor the bridge neither gathers nor converts (a norm, an unsplit embedding) comes back
        # as the live parameter itself when it is already on the target device: copy those, or a
        # caller holding the export would see the next optimizer step.
        live = {p.untyped_storage().data_ptr() for c in self.chunks for p in c.parameters()} if copy_live else set()
        if wait_for is not None or on_exported is not None:
            model_bridge._with_progress_tracking = _task_loop(wait_for, on_exported)
        try:
            for name, tensor in model_bridge.stream_weights_megatron_to_hf(
                    self.chunks, hf_config, cpu=cpu, show_progress=False, conversion_tasks=tasks):
                tensor = self._cast(tensor)
                if tensor.untyped_storage().data_ptr() in live:
                    tensor = tensor.clone()
                yield name, tensor, name in expert_names
        finally:
            model_bridge.__dict__.pop("_with_progress_tracking", None)
        if self.role == "critic":
            head = self._value_head(cpu, wait_for)
            yield cf.VALUE_WEIGHT, self._cast(head), False
            yield cf.VALUE_BIAS, self._cast(torch.zeros(1, dtype=head.dtype, device=head.device)), False

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype:
            return tensor.to(self.dtype)
        return tensor

    def _value_head(self, cpu: bool, wait_for: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """The value head [1, hidden] from the last pipeline stage, on every rank."""
        heads = [_unwrap(c).output_layer.weight.detach() for c in self.chunks
                 if getattr(_unwrap(c), "post_process", False)]
        if wait_for is not None:
            for head in heads:
                wait_for(head)
        local = heads[0].cpu().clone() if heads else None
        if torch.distributed.is_initialized():
            gathered: list[torch.Tensor | None] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, local)
            local = next(h for h in gathered if h is not None)
        return local if cpu or not heads else heads[0].clone()

    # ---- buckets -----------------------------------------------------------------------------

    def buckets(self, bucket_bytes: int, cpu: bool = True, src_rank: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Collective: the stream grouped into dicts of at most `bucket_bytes` (a tensor larger
        than that is a bucket of its own), in stream order. Only `src_rank` receives buckets; on
        every other rank this yields nothing, but it must still be iterated to the end (it runs
        the gathers). The tensors of a yielded bucket are not reused: the consumer may keep them."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        keep = _rank() == src_rank
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        for name, tensor in self.stream(cpu=cpu):
            if not keep:
                continue
            nbytes = tensor_nbytes(tensor)
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = {}, 0
            if name in bucket:
                raise ValueError(f"megatron-bridge exported {name!r} twice in one stream")
            bucket[name] = tensor
            size += nbytes
        if bucket:
            yield bucket


def export_hf_state(chunks: Sequence[torch.nn.Module], hf_dir: str | Path, role: Role = "actor",
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Collective convenience: the whole HF state dict on every rank (small models and tests)."""
    exporter = HFWeightExporter(chunks, hf_dir, role=role, dtype=dtype)
    try:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in exporter.stream():
            out[name] = tensor
        return out
    finally:
        exporter.close()
