"""megatron-sao mcore checkpoint -> HF checkpoint (actor: causal LM; critic: `models.critic_format`).

Every rank runs `convert_mcore_to_hf`. The model is built in the requested layout (the torch_dist
checkpoint reshards into it, loaded in place: `dist_reader.merge_in_place`), megatron-bridge streams
HF tensors one at a time, and the rank that owns each writes it straight to its planned place in the
output shards (`safetensors_stream`; rank 0 creates the files, the others open them): experts are
not gathered across expert-parallel ranks (each rank writes its own), other tensors are shared out
by bytes (`HFWeightExporter.stream_owned`). Host memory is at most the rank's model shard plus one
tensor; on several nodes the output directory must be on a filesystem every rank sees. The export
runs while the model loads (`dist_reader.BackgroundLoad`: every collective of the load runs first,
then the export waits for each parameter it reads), and the manifest's checksums are verified
beside the load, each rank hashing its share of the files (`verified_load`); a checksum
mismatch or a failed load on any rank fails every rank after the export and before anything is
committed (the staging directory is removed). The output tensor
table (names, shapes, dtypes) comes from the manifest, so the export writes exactly the tensors
the source had, in their dtypes; a tensor the bridge yields that is not in the table, or a table
entry it never yields, is an error.

With fast I/O (`--fastio`, docs/conversion.md#fast-io) the load hashes its share in the pass that
reads it, each parameter's pages go back to the OS once it is exported, the load is held at most an
I/O bucket ahead of the export so it reuses them (where the bridge allows it: `reports_exported`),
and the output is written past the page cache where the filesystem allows.
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
from megatron_sao.checkpointing.io_bucket import DEFAULT_IO_BUCKET_BYTES
from megatron_sao.checkpointing.manifest import (
    HF_DIR,
    MANIFEST_FILE,
    PASSTHROUGH_DIR,
    Manifest,
    check_dist_checkpoint_files,
    check_files,
    read_manifest,
)
from megatron_sao.checkpointing.mcore_io import tensor_table
from megatron_sao.checkpointing.model_setup import (
    DTYPES,
    Layout,
    Role,
    build_for_conversion,
    conversion_config,
    one_op_thread,
    shard_bytes,
)
from megatron_sao.checkpointing.output_dir import (
    OUTPUT_MARKERS,
    StagedOutput,
    check_disk_space,
    check_output_dir,
    disk_full_as_value_error,
    human_bytes,
)
from megatron_sao.checkpointing.progress import Progress
from megatron_sao.checkpointing.safetensors_stream import StreamingSafetensorsWriter, TensorSpec
from megatron_sao.checkpointing.verified_load import VerifiedLoad
from megatron_sao.models import critic_format as cf
from megatron_sao.models.hf_export import HFWeightExporter, OwnedTensor
from megatron_sao.models.hf_files import (
    ST_TO_TORCH,
    TORCH_TO_ST,
    expected_hf_tensors,
    is_weight_file,
    read_config,
    read_safetensors_header,
)
from megatron_sao.platform.collective import (
    barrier,
    broadcast_object,
    gather_objects,
    raise_if_any,
    rank,
    sum_over_ranks,
)
from megatron_sao.platform.collective import world_size as get_world_size

EXPORT_MARKER = OUTPUT_MARKERS[1]  # sao_export.json: marks an HF export that --overwrite may replace


@dataclass(kw_only=True)
class McoreToHfRequest:
    mcore_dir: Path
    out_dir: Path
    hf_config_dir: Path | None = None
    """Config + tokenizer to use instead of the checkpoint's hf/ copy (required without a manifest)."""
    layout: Layout = field(default_factory=Layout)
    role: Role | None = None
    """Only for checkpoints without a manifest (default actor, or critic for a critic config)."""
    dtype: str | None = None
    """Export floating tensors in this dtype instead of the source's (e.g. bfloat16 after fp32 training)."""
    overwrite: bool = False
    max_shard_bytes: int = 5 * 10**9
    verify_checksums: bool = True
    """Check every file's digest against the manifest before committing the export (a flipped bit in
    a shard is otherwise exported silently); the files are split over the ranks, each hashed beside
    the load (with `fastio`, in the same pass that loads it)."""
    progress: bool = True
    fastio: bool = False
    """The fast-I/O path (`checkpointing/fastio/`, docs/conversion.md#fast-io): O_DIRECT reads and
    writes, each parameter's memory given back to the OS once exported with the load held at most
    `io_bucket_bytes` ahead of the export, raw item reads checksummed in the load's own pass."""
    io_bucket_bytes: int = DEFAULT_IO_BUCKET_BYTES
    """With `fastio`: how far the load may run ahead of the export (bytes loaded, not yet given back)."""


@dataclass(kw_only=True)
class McoreToHfPlan:
    request: McoreToHfRequest
    manifest: Manifest | None
    config_dir: Path
    config: dict
    family: Family
    role: Role
    params_dtype: torch.dtype
    specs: list[TensorSpec]
    passthrough: list[str]


def _table_from_config(config_dir: Path, config: dict, role: Role, dtype: torch.dtype) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cf.causal_config(config)))
        shapes = expected_hf_tensors(tmp).shapes
    if role == "critic":
        shapes = cf.critic_hf_shapes(shapes, config["hidden_size"])
    return {n: {"dtype": TORCH_TO_ST[dtype], "shape": list(s)} for n, s in shapes.items()}


def _stored_dtype(mcore_dir: Path) -> torch.dtype:
    counts: dict[str, int] = {}
    for meta in tensor_table(mcore_dir).values():
        numel = 1
        for dim in meta["shape"]:
            numel *= dim
        counts[meta["dtype"]] = counts.get(meta["dtype"], 0) + numel
    return DTYPES[max(counts, key=counts.__getitem__)]


def plan_mcore_to_hf(request: McoreToHfRequest) -> McoreToHfPlan:
    """Everything checkable without a model; raises ValueError naming the problem."""
    if request.io_bucket_bytes <= 0:
        raise ValueError(f"--io-bucket-mb must be > 0 (got {request.io_bucket_bytes} bytes)")
    mcore = Path(request.mcore_dir)
    manifest = None
    if request.hf_config_dir is None or (mcore / MANIFEST_FILE).is_file():
        manifest = read_manifest(mcore)
        check_files(mcore, manifest, verify_hashes=False)  # sizes here; checksums while loading
    else:
        check_dist_checkpoint_files(mcore)
    config_dir = Path(request.hf_config_dir) if request.hf_config_dir is not None else mcore / HF_DIR
    config = read_config(config_dir)
    family = family_of(config, str(config_dir))
    role: Role = manifest.role if manifest else (request.role or ("critic" if cf.is_critic_config(config) else "actor"))
    if manifest and request.role and request.role != manifest.role:
        raise ValueError(f"{mcore} holds a {manifest.role} (manifest), not a {request.role}")
    check_output_dir(Path(request.out_dir), request.overwrite, sources=(mcore, request.hf_config_dir))
    params_dtype = DTYPES[manifest.params_dtype] if manifest else _stored_dtype(mcore)
    if request.dtype is not None and request.dtype not in DTYPES:
        raise ValueError(f"--dtype {request.dtype}: choose one of {', '.join(DTYPES)}")
    table = dict(manifest.hf_tensors) if manifest else _table_from_config(config_dir, config, role, params_dtype)
    specs = []
    for name, meta in table.items():
        code = meta["dtype"]
        if request.dtype is not None and ST_TO_TORCH[code].is_floating_point and name not in (manifest.passthrough
                                                                                              if manifest else []):
            code = TORCH_TO_ST[DTYPES[request.dtype]]
        specs.append(TensorSpec(name, code, tuple(meta["shape"])))
    check_disk_space(Path(request.out_dir), sum(s.nbytes for s in specs))
    return McoreToHfPlan(request=request, manifest=manifest, config_dir=config_dir, config=config, family=family,
                         role=role, params_dtype=params_dtype, specs=specs,
                         passthrough=list(manifest.passthrough) if manifest else [])


class _Sink:
    """This rank's end of the export: checks each tensor it owns against the plan, casts, writes
    it into the output files (which rank 0 creates: `create`)."""

    def __init__(self, plan: McoreToHfPlan, directory: Path, progress: Progress, create: bool) -> None:
        self.by_name = {s.name: s for s in plan.specs}
        self.writer = StreamingSafetensorsWriter(directory, plan.specs, plan.request.max_shard_bytes, create=create,
                                                 fastio=plan.request.fastio)
        self.progress = progress
        self.expert_parallel = plan.request.layout.ep
        self.errors: list[str] = []
        self.rounded: list[str] = []

    def take(self, item: OwnedTensor) -> None:
        """Every tensor of this rank's stream: written if owned, counted for progress either way."""
        spec = self.by_name.get(item.name)
        nbytes = spec.nbytes if spec is not None else item.tensor.numel() * item.tensor.element_size()
        self.progress.advance(nbytes * (self.expert_parallel if item.expert_local else 1))
        if item.owned:
            self.put(item.name, item.tensor)

    def unwritten_or_twice(self) -> list[str]:
        """Collective: every tensor of the plan must have been written by exactly one rank."""
        counts = sum_over_ranks(torch.tensor(self.writer.written_flags(), dtype=torch.int32)).tolist()
        names = list(self.writer.slots)
        missing = [n for n, c in zip(names, counts, strict=True) if c == 0]
        twice = [n for n, c in zip(names, counts, strict=True) if c > 1]
        errors = [f"export did not produce {len(missing)} tensors of the source, e.g. {missing[:3]}"] if missing else []
        assert not twice, f"{len(twice)} tensors written by more than one rank, e.g. {twice[:3]}"
        return errors

    def put(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.by_name.get(name)
        if spec is None:
            self.errors.append(f"export produced tensor {name!r}, which the source checkpoint did not have")
            return
        if tuple(tensor.shape) != spec.shape:
            self.errors.append(f"export produced {name!r} with shape {list(tensor.shape)}, the source had "
                               f"{list(spec.shape)}")
            return
        target = ST_TO_TORCH[spec.dtype]
        if tensor.dtype != target:
            cast = tensor.to(target)
            if not torch.equal(cast.to(tensor.dtype), tensor):
                self.rounded.append(name)
            tensor = cast
        self.writer.write(name, tensor)


def _open_sink(plan: McoreToHfPlan, directory: Path, progress: Progress) -> _Sink:
    """Collective: rank 0 creates the output files, then every other rank opens them."""
    sink = None
    for creating in (True, False):
        problems = []
        if (rank() == 0) == creating:
            try:
                sink = _Sink(plan, directory, progress, create=creating)
            except (OSError, ValueError) as e:
                problems.append(f"rank {rank()}: {e}")
        raise_if_any(problems)
    assert sink is not None
    return sink


def _copy_config_files(plan: McoreToHfPlan, tmp: Path) -> None:
    """Tokenizer, generation config etc. of the config directory (never its weights or index),
    and `sao_export.json`, which marks the directory as an export `--overwrite` may replace."""
    for entry in sorted(plan.config_dir.iterdir()):
        if entry.is_file() and entry.name not in ("config.json", EXPORT_MARKER) and not is_weight_file(entry.name):
            shutil.copy2(entry, tmp / entry.name)
    marker = {"source": str(Path(plan.request.mcore_dir).resolve()), "role": plan.role,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    if plan.role == "critic" and not cf.is_critic_config(plan.config):
        (tmp / "config.json").write_text(json.dumps(cf.critic_config(plan.config), indent=2) + "\n")
    else:
        shutil.copy2(plan.config_dir / "config.json", tmp / "config.json")  # written last: marks completeness


def convert_mcore_to_hf(request: McoreToHfRequest) -> dict:
    """Collective (every rank): export; returns a summary (meaningful on rank 0)."""
    start = time.monotonic()
    phases: dict[str, float] = {}
    plan = plan_mcore_to_hf(request)
    phases["plan"] = time.monotonic() - start
    out, mcore = Path(request.out_dir), Path(request.mcore_dir)
    staged = StagedOutput.for_token(out, broadcast_object(StagedOutput.new_token() if rank() == 0 else None))
    view_root = Path(tempfile.mkdtemp(prefix="sao-convert-view-"))
    sink = None
    try:
        if rank() == 0:
            with disk_full_as_value_error(staged.tmp):
                staged.create()
        barrier()
        view = cf.causal_view(plan.config_dir, plan.config, view_root / "hf")
        config = conversion_config(view, request.layout, get_world_size(), plan.params_dtype)
        chunks = build_for_conversion(config, plan.role)
        rank_bytes = shard_bytes(chunks)
        phases["build"] = time.monotonic() - start - sum(phases.values())
        out_bytes = sum(s.nbytes for s in plan.specs)
        progress = Progress("mcore -> hf", total_bytes=rank_bytes + out_bytes, enabled=request.progress and rank() == 0)
        progress.start_phase("convert")
        with disk_full_as_value_error(staged.tmp), one_op_thread():
            sink = _open_sink(plan, staged.tmp, progress)
            load = VerifiedLoad(mcore, plan.manifest if request.verify_checksums else None, chunks, progress,
                                fastio=request.fastio, window_bytes=request.io_bucket_bytes)
            overlapped = load.background is not None
            exporter = None
            try:
                exporter = HFWeightExporter(chunks, view, role=plan.role)
                give_back = load.give_back if request.fastio and overlapped and exporter.reports_exported() \
                    else None
                if give_back is None:
                    load.close_window()  # nothing will be given back: the load must not wait for it
                for item in exporter.stream_owned(cpu=True, wait_for=load.wait_for, may_alias=True,
                                                  on_exported=give_back):
                    # The exporter always appends a zero score.bias; a critic saved without one has none.
                    if not (item.name == cf.VALUE_BIAS and item.name not in sink.by_name):
                        sink.take(item)
            finally:
                load.close_window()
                if exporter is not None:
                    exporter.close()
            load.finish()
            loaded_at = load.loaded_at
            phases["load"] = loaded_at - start - sum(phases.values())
            if rank() == 0:
                _copy_passthrough(plan, mcore, sink)
            raise_if_any(sink.errors + sink.unwritten_or_twice())
            sink.writer.close(fsync=rank() != 0)  # rank 0's commit syncs its own files (and the tree)
            barrier()
            if rank() == 0:
                _copy_config_files(plan, staged.tmp)
                staged.commit()
        barrier()
        progress.close()
    except BaseException:
        if sink is not None:
            sink.writer.abort()
        if rank() == 0:
            staged.abort()
        raise
    finally:
        shutil.rmtree(view_root, ignore_errors=True)
    seconds = time.monotonic() - start
    phases["export"] = seconds - sum(phases.values())
    total = sum(s.nbytes for s in plan.specs)
    rounded = sorted({name for names in gather_objects(sink.rounded) for name in names})
    return {
        "phases": phases, "out": str(out), "role": plan.role, "architecture": plan.family.architecture,
        "tensors": len(plan.specs),
        "shard_bytes": rank_bytes,
        "bytes": total, "rounded": rounded, "seconds": seconds, "load_seconds": loaded_at - start,
        "load_overlapped": overlapped,
        "fastio": request.fastio,
        "released_bytes": load.released_bytes,
        # this rank's share of the manifest's files, and how many of them the load hashed as it read them
        "checksum_files": len(load.share),
        "checksummed_while_loading": load.hashed_while_loading,
        "load_held_back": load.window.held_back if load.window is not None else 0,
        "export_seconds": time.monotonic() - loaded_at,
        "summary": (f"{mcore} ({plan.role}, {plan.family.architecture}) -> {out}: {len(plan.specs)} tensors, "
                    f"{human_bytes(total)} [{request.layout.describe()}, {get_world_size()} ranks] in {seconds:.1f} s"
                    + (f"; {len(rounded)} tensors rounded to their export dtype" if rounded else "")),
    }


def _copy_passthrough(plan: McoreToHfPlan, mcore: Path, sink: _Sink) -> None:
    if not plan.passthrough:
        return
    from safetensors import safe_open

    directory = mcore / PASSTHROUGH_DIR
    for file in sorted(directory.glob("*.safetensors")):
        names = [n for n in read_safetensors_header(file) if n in plan.passthrough]
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                sink.take(OwnedTensor(name, f.get_tensor(name), owned=True, expert_local=False))
