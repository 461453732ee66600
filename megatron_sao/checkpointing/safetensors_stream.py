"""Write a sharded HF safetensors checkpoint tensor by tensor, in any arrival order.

megatron-bridge yields exported tensors one at a time in its own order. Buffering a shard's worth
before writing would hold gigabytes; instead every tensor's place is planned up front from the
known name/dtype/shape list (the manifest), each shard file is created at its final size with its
header, and each arriving tensor is written straight to its offset (`os.pwrite`; with fast I/O
`fastio.direct_io.PositionalWriter`: its whole blocks with O_DIRECT where the filesystem takes it,
the rest through the page cache with its write-back started at once), overlapping the export of
the next. Memory: one tensor.

Several writers can share the files: the layout is a pure function of the tensor list, so one
process creates the files (`create=True`) and the others open them (`create=False`) and write
their own tensors to the same planned offsets (`sao convert mcore-to-hf` on N ranks).

Layout follows `save_pretrained`: `model.safetensors`, or `model-0000i-of-0000n.safetensors`
plus `model.safetensors.index.json`. Within a file, tensors are ordered by element size
(largest first) then name, so every tensor is aligned for zero-copy loading.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_sao.models.hf_files import INDEX_FILE, ST_TO_TORCH, TORCH_TO_ST


def natural_key(name: str) -> list[object]:
    """Sort key that orders layer 2 before layer 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * ST_TO_TORCH[self.dtype].itemsize


class _BufferedWriter:
    """Writes at any offset of the file open as `fd` (the caller's), through the page cache."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: memoryview, offset: int) -> None:
        while data:
            n = os.pwrite(self.fd, data, offset)
            data, offset = data[n:], offset + n

    def close(self) -> None:
        """Nothing of its own to close."""


@dataclass(slots=True)
class _Slot:
    spec: TensorSpec
    file: str
    offset: int  # absolute, in the file
    written: bool = False


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy split in natural name order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in sorted(specs, key=lambda s: natural_key(s.name)):
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


class StreamingSafetensorsWriter:
    """Pre-planned sharded safetensors output in `directory` (which must exist). With
    `create=False` the files must already exist, created by another writer of the same plan. With
    `fastio`, writes go past the page cache where the filesystem allows (`fastio.direct_io`)."""

    def __init__(self, directory: Path, specs: list[TensorSpec], max_shard_bytes: int, create: bool = True,
                 fastio: bool = False) -> None:
        self.directory = directory
        self.create = create
        self.fastio = fastio
        self.slots: dict[str, _Slot] = {}
        self._fds: dict[str, int] = {}
        self._writers: dict[str, Any] = {}
        shards = plan_shards(specs, max_shard_bytes)
        count = len(shards)
        self.weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            file = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            self._create(file, shard)

    def _create(self, file: str, shard: list[TensorSpec]) -> None:
        ordered = sorted(shard, key=lambda s: (-ST_TO_TORCH[s.dtype].itemsize, natural_key(s.name)))
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        begin = 0
        for spec in ordered:
            header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                                 "data_offsets": [begin, begin + spec.nbytes]}
            begin += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        data_start = 8 + len(raw)
        path = self.directory / file
        if self.create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds[file] = fd
            os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
            os.ftruncate(fd, data_start + begin)
        else:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise ValueError(f"{path}: not found; the process that creates the output has not, or this one "
                                 f"cannot see its directory (several writers need a shared filesystem)") from None
            self._fds[file] = fd
            if os.fstat(fd).st_size != data_start + begin:
                raise ValueError(f"{path}: {os.fstat(fd).st_size} bytes, the plan has {data_start + begin}: "
                                 f"created from another tensor list")
        if self.fastio:
            from megatron_sao.checkpointing.fastio.direct_io import PositionalWriter

            self._writers[file] = PositionalWriter(path, fd)
        else:
            self._writers[file] = _BufferedWriter(fd)
        for spec in ordered:
            offset = data_start + header[spec.name]["data_offsets"][0]  # type: ignore[index]
            self.slots[spec.name] = _Slot(spec=spec, file=file, offset=offset)
            self.weight_map[spec.name] = file

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Write `tensor` (already in its planned dtype and shape) to its place; returns bytes written."""
        slot = self.slots.get(name)
        if slot is None:
            raise KeyError(name)
        assert not slot.written, f"{name} written twice"
        assert TORCH_TO_ST[tensor.dtype] == slot.spec.dtype and tuple(tensor.shape) == slot.spec.shape, (
            name, tensor.dtype, tuple(tensor.shape), slot.spec)
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._writers[slot.file].write(memoryview(data), slot.offset)
        slot.written = True
        return slot.spec.nbytes

    def missing(self) -> list[str]:
        return sorted((n for n, s in self.slots.items() if not s.written), key=natural_key)

    def written_flags(self) -> list[int]:
        """1 per tensor this writer wrote, in plan order (the same on every writer of the plan)."""
        return [int(slot.written) for slot in self.slots.values()]

    def close(self, fsync: bool = False) -> None:
        """Close the files (after `fsync` of each, where another process commits them) and, for the
        writer that created them, write the index (when sharded). Call after every tensor is written."""
        self._close_writers()
        for fd in self._fds.values():
            if fsync:
                os.fsync(fd)
            os.close(fd)
        self._fds.clear()
        files = set(self.weight_map.values())
        if self.create and len(files) > 1:
            total = sum(s.spec.nbytes for s in self.slots.values())
            weight_map = {n: self.weight_map[n] for n in sorted(self.weight_map, key=natural_key)}
            (self.directory / INDEX_FILE).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")

    def _close_writers(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def abort(self) -> None:
        self._close_writers()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
