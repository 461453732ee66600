"""HF checkpoint -> megatron-sao mcore checkpoint (torch_dist), for the actor or the critic.

Every rank runs `convert_hf_to_mcore` (torchrun / srun / `run_distributed`); the model is built in
the requested TP/PP/EP layout, so each rank holds only its shard of it, and reads only the HF
tensors its shard needs. Peak host memory per rank is its shard plus the I/O bucket (HF tensors
read ahead, `hf_reader`; tensors staged for the torch_dist writer, `dist_writer`) plus the tensors
of the one conversion task in flight, never a second copy of the shard
(docs/conversion.md#memory-and-streaming). The save runs while the load fills the model: each
parameter is written once it is filled (`FillTracker`), so reading, converting and writing overlap;
read-ahead and write staging get half of the bucket each. The .distcp files are hashed while they
are written. With fast I/O (`fastio`, docs/conversion.md#fast-io) reads and writes go past the
page cache where the filesystem allows, and once written a parameter's memory goes back to the OS
(`fastio.page_release`): the next parameters reuse its pages.
Checks that need no model (`plan_hf_to_mcore`) run first, on every rank, before any collective.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_sao.checkpointing.families import Family, family_of
from megatron_sao.checkpointing.fill_tracker import FillTracker
from megatron_sao.checkpointing.hf_load import LoadSpec, float_state, load_hf_weights
from megatron_sao.checkpointing.io_bucket import DEFAULT_IO_BUCKET_BYTES
from megatron_sao.checkpointing.keys import unwrap
from megatron_sao.checkpointing.manifest import HF_DIR, PASSTHROUGH_DIR, Manifest, library_versions, write_manifest
from megatron_sao.checkpointing.mcore_io import save_model, tensor_table
from megatron_sao.checkpointing.model_setup import (
    DTYPES,
    Layout,
    Role,
    build_for_conversion,
    conversion_config,
    dtype_name,
    one_op_thread,
    shard_bytes,
)
from megatron_sao.checkpointing.output_dir import (
    StagedOutput,
    check_disk_space,
    check_output_dir,
    disk_full_as_value_error,
    human_bytes,
)
from megatron_sao.checkpointing.progress import Progress
from megatron_sao.checkpointing.safetensors_stream import StreamingSafetensorsWriter, TensorSpec
from megatron_sao.models import critic_format as cf
from megatron_sao.models.bridge_compat import load_auto_bridge
from megatron_sao.models.hf_files import (
    HFCheckpoint,
    check_weights_match_config,
    expected_hf_tensors,
    inspect_hf_checkpoint,
    is_weight_file,
)
from megatron_sao.platform.collective import barrier, broadcast_object, gather_objects, rank, world_size


@dataclass(kw_only=True)
class HfToMcoreRequest:
    hf_dir: Path
    out_dir: Path
    layout: Layout = field(default_factory=Layout)
    role: Role | None = None
    """None: critic for a critic checkpoint, else actor."""
    overwrite: bool = False
    seed: int = 1234
    """Seed of the value head when one is initialised."""
    value_head_init_std: float = 0.02
    progress: bool = True
    io_bucket_bytes: int = DEFAULT_IO_BUCKET_BYTES
    """Per rank: at most this many bytes of HF tensors read ahead, and of tensors staged for writing."""
    io_threads: int = 2
    """torch_dist writer threads per rank (one file each)."""
    fastio: bool = False
    """The fast-I/O path (`checkpointing/fastio/`, docs/conversion.md#fast-io): HF tensors read and
    .distcp files written past the page cache (O_DIRECT) where the filesystem allows, read buffers
    pooled, each parameter's memory given back to the OS once it is written."""


@dataclass(kw_only=True)
class HfToMcorePlan:
    request: HfToMcoreRequest
    checkpoint: HFCheckpoint
    family: Family
    role: Role
    source_is_critic: bool
    params_dtype: torch.dtype
    hf_tensors: dict[str, dict]
    passthrough: list[str]
    payload_bytes: int


def _params_dtype(checkpoint: HFCheckpoint) -> torch.dtype:
    """The floating dtype holding most of the checkpoint's bytes (the model is built in it)."""
    by_dtype: dict[torch.dtype, int] = {}
    for info in checkpoint.tensors.values():
        by_dtype[info.torch_dtype] = by_dtype.get(info.torch_dtype, 0) + info.nbytes
    dtype = max(by_dtype, key=by_dtype.__getitem__)
    if dtype not in DTYPES.values():
        raise NotImplementedError(f"{checkpoint.path}: weights are mostly {dtype}; conversion handles "
                                  "float32/bfloat16/float16 checkpoints (issue 4, docs/conversion.md#families)")
    return dtype


def check_hf_source(source: Path) -> tuple[HFCheckpoint, Family, bool, list[str]]:
    """An HF checkpoint as conversion and verification read it: of a supported family, every tensor
    config.json implies there with that shape (a config that disagrees with the weights is named
    with the tensor), nothing unexplained beside them. Returns (checkpoint, family, whether it is a
    critic, the tensors carried through unchanged); ValueError naming the problem."""
    checkpoint = inspect_hf_checkpoint(source)
    family = family_of(checkpoint.config, str(source))
    source_is_critic = cf.is_critic_config(checkpoint.config)
    if checkpoint.architecture.endswith("ForTokenClassification") and not source_is_critic:
        raise ValueError(f"{source}: a token-classification checkpoint with "
                         f"{len(checkpoint.config.get('id2label', {}))} labels is not a critic (one label)")
    with tempfile.TemporaryDirectory() as config_dir:
        (Path(config_dir) / "config.json").write_text(json.dumps(cf.causal_config(checkpoint.config)))
        expected = expected_hf_tensors(config_dir)
    shapes = expected.shapes
    if source_is_critic:
        shapes = cf.critic_hf_shapes(shapes, checkpoint.config["hidden_size"])
        if cf.VALUE_BIAS not in checkpoint.tensors:
            shapes.pop(cf.VALUE_BIAS)
    passthrough = check_weights_match_config(checkpoint, shapes, expected)
    return checkpoint, family, source_is_critic, passthrough


def plan_hf_to_mcore(request: HfToMcoreRequest) -> HfToMcorePlan:
    """Everything checkable without a model; raises ValueError naming the problem."""
    source = Path(request.hf_dir)
    checkpoint, family, source_is_critic, passthrough = check_hf_source(source)
    role = request.role or ("critic" if source_is_critic else "actor")
    if role == "actor" and source_is_critic:
        raise ValueError(f"{source} is a critic checkpoint (value head, no LM head): convert it with --role critic")
    check_output_dir(Path(request.out_dir), request.overwrite, sources=(source,))
    if source_is_critic:
        _check_value_bias(checkpoint)
    params_dtype = _params_dtype(checkpoint)
    hf_tensors = {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in sorted(checkpoint.tensors.items())}
    if role == "critic" and not source_is_critic:
        hf_tensors.pop(cf.LM_HEAD)
        code = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[params_dtype]
        hidden = checkpoint.config["hidden_size"]
        hf_tensors[cf.VALUE_WEIGHT] = {"dtype": code, "shape": [1, hidden]}
        hf_tensors[cf.VALUE_BIAS] = {"dtype": code, "shape": [1]}
    payload = sum(max(t.nbytes, t.nbytes * params_dtype.itemsize // max(t.torch_dtype.itemsize, 1))
                  for t in checkpoint.tensors.values())
    check_disk_space(Path(request.out_dir), payload)
    return HfToMcorePlan(request=request, checkpoint=checkpoint, family=family, role=role,
                         source_is_critic=source_is_critic, params_dtype=params_dtype, hf_tensors=hf_tensors,
                         passthrough=passthrough, payload_bytes=payload)


def _copy_hf_side_files(plan: HfToMcorePlan, tmp: Path) -> None:
    """Config, tokenizer and generation files (no weights) into <ckpt>/hf; carried tensors into
    <ckpt>/hf_passthrough."""
    source = plan.checkpoint.path
    (tmp / HF_DIR).mkdir()
    for entry in sorted(source.iterdir()):
        if entry.is_file() and not is_weight_file(entry.name):
            shutil.copy2(entry, tmp / HF_DIR / entry.name)
    if not plan.passthrough:
        return
    from safetensors import safe_open

    (tmp / PASSTHROUGH_DIR).mkdir()
    infos = [plan.checkpoint.tensors[n] for n in plan.passthrough]
    writer = StreamingSafetensorsWriter(tmp / PASSTHROUGH_DIR, [TensorSpec(i.name, i.dtype, i.shape) for i in infos],
                                        max_shard_bytes=5 * 10**9)
    for info in infos:
        with safe_open(str(source / info.file), framework="pt") as f:
            writer.write(info.name, f.get_tensor(info.name))
    writer.close()


def _check_value_bias(checkpoint: HFCheckpoint) -> None:
    """megatron-sao's value head has no bias: a critic with a non-zero score.bias cannot convert exactly."""
    from safetensors import safe_open

    info = checkpoint.tensors.get(cf.VALUE_BIAS)
    if info is None:
        return
    with safe_open(str(checkpoint.path / info.file), framework="pt") as f:
        bias = f.get_tensor(cf.VALUE_BIAS)
    if bias.abs().max().item() != 0.0:
        raise ValueError(f"{checkpoint.path}: {cf.VALUE_BIAS} is non-zero ({bias.tolist()}); megatron-sao's value "
                         "head has no bias, so this critic cannot be converted exactly")


def _load_value_head(plan: HfToMcorePlan, chunks: list[torch.nn.Module]) -> dict:
    """Copy the source critic's score.weight into the value head (on the ranks holding it)."""
    from safetensors import safe_open

    source = plan.checkpoint
    info = source.tensors[cf.VALUE_WEIGHT]
    for chunk in chunks:
        model = unwrap(chunk)
        if getattr(model, "post_process", False):
            with safe_open(str(source.path / info.file), framework="pt") as f, torch.no_grad():
                model.output_layer.weight.copy_(f.get_tensor(cf.VALUE_WEIGHT))
    return {"loaded_from": cf.VALUE_WEIGHT}


def convert_hf_to_mcore(request: HfToMcoreRequest) -> dict:
    """Collective (every rank): convert; returns a summary (meaningful on rank 0)."""
    start = time.monotonic()
    phases: dict[str, float] = {}
    plan = plan_hf_to_mcore(request)
    if request.io_bucket_bytes <= 0 or request.io_threads <= 0:
        raise ValueError(f"--io-bucket-mb and --io-threads must be > 0 (got {request.io_bucket_bytes} bytes, "
                         f"{request.io_threads} threads)")
    phases["plan"] = time.monotonic() - start
    out = Path(request.out_dir)
    staged = StagedOutput.for_token(out, broadcast_object(StagedOutput.new_token() if rank() == 0 else None))
    view_root = Path(tempfile.mkdtemp(prefix="sao-convert-view-"))
    try:
        if rank() == 0:
            with disk_full_as_value_error(staged.tmp):
                staged.create()
        barrier()
        view = cf.causal_view(plan.checkpoint.path, plan.checkpoint.config, view_root / "hf")
        config = conversion_config(view, request.layout, world_size(), plan.params_dtype, seed=request.seed,
                                   value_head_init_std=request.value_head_init_std)
        chunks = build_for_conversion(config, plan.role)
        rank_bytes = shard_bytes(chunks)
        phases["build"] = time.monotonic() - start - sum(phases.values())
        # one line for the whole conversion: rank 0's reads and writes, which overlap (the write
        # estimated as the shard until the save plan says exactly, the read until the tasks do)
        progress = Progress("hf -> mcore", total_bytes=2 * rank_bytes, enabled=request.progress and rank() == 0)
        planned = {"read": rank_bytes, "write": rank_bytes}

        def planned_bytes(kind: str, nbytes: int) -> None:
            planned[kind] = nbytes
            progress.start_phase("convert", planned["read"] + planned["write"])

        handled = set(plan.passthrough)
        if plan.role == "critic":
            handled |= {cf.VALUE_WEIGHT, cf.VALUE_BIAS, cf.LM_HEAD}
        # the load and the save overlap, so each gets half of the bucket
        bucket = max(1, request.io_bucket_bytes // 2)
        spec = LoadSpec(checkpoint=plan.checkpoint, handled_hf_tensors=frozenset(handled),
                        skip_megatron_prefixes=("output_layer.",) if plan.role == "critic" else (),
                        io_bucket_bytes=bucket, on_read_planned=lambda n: planned_bytes("read", n),
                        on_bytes=progress.advance, fastio=request.fastio)
        tracker = FillTracker(tensor for _, tensor in float_state(chunks, ()))
        value_head: dict | None = None
        loaded_at = 0.0

        def fill() -> None:
            nonlocal value_head, loaded_at
            load_hf_weights(load_auto_bridge(view), chunks, spec, tracker)
            if plan.role == "critic":
                value_head = {"initialized": True, "init_std": request.value_head_init_std, "seed": request.seed}
                if plan.source_is_critic:
                    value_head = _load_value_head(plan, chunks)
            tracker.finish()
            loaded_at = time.monotonic()

        with disk_full_as_value_error(staged.tmp):
            with one_op_thread():
                written = save_model(chunks, staged.tmp, thread_count=request.io_threads, bucket_bytes=bucket,
                                     on_bytes=progress.advance, on_planned=lambda n: planned_bytes("write", n),
                                     fill=fill, tracker=tracker, fastio=request.fastio)
            phases["load"] = loaded_at - start - sum(phases.values())
            hashed = {name: entry for files in gather_objects(written) for name, entry in files.items()}
            barrier()
            phases["save"] = time.monotonic() - start - sum(phases.values())
            progress.start_phase("finish")
            if rank() == 0:
                _copy_hf_side_files(plan, staged.tmp)
                manifest = Manifest(
                    role=plan.role, architecture=plan.family.architecture, params_dtype=dtype_name(plan.params_dtype),
                    source=str(plan.checkpoint.path.resolve()),
                    source_format=cf.CRITIC_FORMAT if plan.source_is_critic else "causal_lm",
                    layout=request.layout.as_dict(world_size()), hf_tensors=plan.hf_tensors,
                    passthrough=plan.passthrough, value_head=value_head,
                    mcore_tensors=tensor_table(staged.tmp), versions=library_versions())
                write_manifest(staged.tmp, manifest, known=hashed)
                staged.commit()
        barrier()
        progress.close()
    except BaseException:
        if rank() == 0:
            staged.abort()
        raise
    finally:
        shutil.rmtree(view_root, ignore_errors=True)
    seconds = time.monotonic() - start
    phases["manifest"] = seconds - sum(phases.values())
    return {
        "phases": phases, "out": str(out), "role": plan.role, "architecture": plan.family.architecture,
        "params_dtype": dtype_name(plan.params_dtype), "hf_tensors": len(plan.checkpoint.tensors),
        "hf_bytes": plan.checkpoint.total_bytes, "passthrough": plan.passthrough, "value_head": value_head,
        "shard_bytes": rank_bytes, "fastio": request.fastio,
        "seconds": seconds, "load_seconds": loaded_at - start, "save_seconds": time.monotonic() - loaded_at,
        "summary": (f"{plan.checkpoint.path} ({plan.family.architecture}, {len(plan.checkpoint.tensors)} tensors, "
                    f"{human_bytes(plan.checkpoint.total_bytes)}) -> {out} as {plan.role} "
                    f"[{request.layout.describe()}, {world_size()} ranks, {dtype_name(plan.params_dtype)}] "
                    f"in {seconds:.1f} s"),
    }
