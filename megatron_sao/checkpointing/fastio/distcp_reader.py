"""torch's torch_dist `FileSystemReader` with one thread per file, tensor items read straight into
their targets, and the files a rank verifies hashed in the same pass that loads them.

torch reads the `.distcp` files one after the other, each tensor item through `torch.load` plus a
copy into its target (2.2 CPU-s per GB on the CI VM with the page cache warm, against 0.3 for a
`preadv` straight into the target: docs/conversion.md#fast-io). `ParallelFileReader` reads the
files in parallel threads (items in offset order), and reads an item that is its target's whole
saved chunk raw (`distcp_items.storage_range`); other items (a slice of a saved chunk after a
layout change, a dtype change, objects) go through torch's reader as before. The files
`FileDigests` wants are read whole in one pass that hashes them and fills their raw items
(`distcp_stream`), instead of a second read by a checksum thread. With a `LoadWindow`, each raw
read first waits for room in it. `FastLoad` is what `mcore_io.start_load_model` takes to use it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from megatron_sao.checkpointing.fastio.distcp_items import storage_range
from megatron_sao.checkpointing.fastio.distcp_stream import FileDigests, StreamItem, stream_file
from megatron_sao.checkpointing.fastio.load_window import LoadWindow


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class FastLoad:
    """How a torch_dist load reads its tensors on the fast-I/O path (`mcore_io.start_load_model`)."""

    window: LoadWindow | None = None
    """Holds a background load's reads at most its capacity ahead of what the consumer gave back."""
    digests: FileDigests | None = None
    """The files to hash as they are read (this rank's checksum share)."""
    thread_count: int = 2

    def reader(self, path: str | Path, background: bool) -> ParallelFileReader:
        """The reader of one load (the window only holds back a load that runs beside its consumer)."""
        return ParallelFileReader(path, self.thread_count, self.window if background else None, self.digests)


class ParallelFileReader(FileSystemReader):
    """See the module docstring."""

    def __init__(self, path: str | Path, thread_count: int, window: LoadWindow | None = None,
                 digests: FileDigests | None = None) -> None:
        super().__init__(path)
        self.thread_count = max(1, thread_count)
        self.window = window
        self.digests = digests
        self.raw_items = 0
        """Tensor items read straight into their target (the rest: `torch.load`)."""
        self._count_lock = threading.Lock()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name in self.digests.wanted if self.digests is not None else ():
            per_file.setdefault(name, [])
        hashed = self.digests.wanted if self.digests is not None else {}
        # files read in part first (e.g. the replicated tensors another rank saved): they are quick,
        # and a whole-file pass started first would keep the export waiting for them
        files = [(name, sorted(items, key=lambda i: self.storage_data[i.storage_index].offset))
                 for name, items in sorted(per_file.items(), key=lambda entry: entry[0] in hashed)]
        if len(files) <= 1 or self.thread_count == 1:
            for name, items in files:
                self._read_file(name, items, plan, planner)
        else:
            with ThreadPoolExecutor(max_workers=min(self.thread_count, len(files)),
                                    thread_name_prefix="sao-torch-dist-read") as pool:
                for future in [pool.submit(self._read_file, name, items, plan, planner) for name, items in files]:
                    future.result()
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_file(self, relative: str, items: list[ReadItem], plan: LoadPlan, planner: LoadPlanner) -> None:
        path = os.path.join(self.path, relative)
        hashed = self.digests is not None and relative in self.digests.wanted
        rest: list[ReadItem] = []
        streamed: list[StreamItem] = []
        with open(path, "rb", buffering=0) as file:
            if hashed and hasattr(os, "posix_fadvise"):  # (Linux) only the probes below read through
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # the page cache: no read-ahead
            for item in items:
                found = self._raw_target(file.fileno(), item, planner)
                if found is None:
                    rest.append(item)
                elif hashed:
                    streamed.append(_stream_item(item, *found, planner))
                else:
                    self._fill(file.fileno(), path, item, *found, planner)
        if hashed:
            assert self.digests is not None
            self.digests.found[relative] = stream_file(path, streamed, self.digests.wanted[relative],
                                                       admit=self.window.admit if self.window is not None else None)
        with self._count_lock:
            self.raw_items += len(items) - len(rest)
        if rest:
            FileSystemReader.read_data(self, dataclasses.replace(plan, items=rest), planner).wait()

    def _raw_target(self, fd: int, item: ReadItem, planner: LoadPlanner) -> tuple[int, torch.Tensor] | None:
        """(where its bytes start, its target) if `item` is its target's whole saved chunk."""
        info = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or info.transform_descriptors or any(item.storage_offsets):
            return None
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != tuple(item.lengths):
            return None
        start = storage_range(fd, info.offset, info.length, target.dtype, tuple(item.lengths))
        return None if start is None else (start, target)

    def _fill(self, fd: int, path: str, item: ReadItem, start: int, target: torch.Tensor,
              planner: LoadPlanner) -> None:
        """Read `item`'s bytes at `start` straight into `target`."""
        if self.window is not None:
            self.window.admit(_nbytes(target))
        buffer = target if target.is_contiguous() else torch.empty_like(target, memory_format=torch.contiguous_format)
        view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
        while view:
            n = os.preadv(fd, [view], start)
            if n <= 0:
                raise OSError(f"{path}: ends inside tensor item {item.storage_index.fqn!r}: truncated file")
            view, start = view[n:], start + n
        if buffer is not target:
            target.copy_(buffer)
        planner.commit_tensor(item, target)


def _stream_item(item: ReadItem, start: int, target: torch.Tensor, planner: LoadPlanner) -> StreamItem:
    if target.is_contiguous():
        return StreamItem(name=item.storage_index.fqn, start=start, target=target,
                          done=lambda: planner.commit_tensor(item, target))
    buffer = torch.empty_like(target, memory_format=torch.contiguous_format)

    def done() -> None:
        target.copy_(buffer)
        planner.commit_tensor(item, target)

    return StreamItem(name=item.storage_index.fqn, start=start, target=buffer, done=done)
