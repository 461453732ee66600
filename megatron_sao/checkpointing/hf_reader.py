"""HF tensors for megatron-bridge, read ahead of the conversion within an I/O bucket.

megatron-bridge reads an HF tensor when a conversion task asks for it, through safetensors'
`safe_open` (a new mmap and a header parse per tensor), then converts it: reading and converting
take turns, so the disk idles while the CPU converts and the other way round. `PrefetchingSource`
is a megatron-bridge `StateSource` that is told the order the tasks will ask (`start`) and reads
ahead in a thread, never more than `bucket_bytes` ahead (a larger tensor is read alone), with
`preadv` straight into the tensor's memory: no mmap, so no file pages counted in the process's
resident memory, and one read per tensor, through the page cache into a new buffer. With fast I/O
(`fastio=True`: `fastio.hf_direct`) past the page cache where the filesystem takes O_DIRECT, into
pooled buffers that serve later reads once the conversion dropped their tensor. A rank reads only
the tensors its own tasks ask for (on N ranks, its shard's). A tensor asked for before the thread
got to it (or a second time) is read on the spot; a prefetched one never asked for only stalls
read-ahead, never the conversion.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING

import torch

from megatron_sao.models.bridge_compat import import_auto_bridge
from megatron_sao.models.hf_files import HFCheckpoint, TensorInfo

if TYPE_CHECKING:
    from megatron_sao.checkpointing.fastio.hf_direct import DirectTensorReads

import_auto_bridge()  # megatron.bridge imports Transformer Engine: without it, its stub must be in place first
from megatron.bridge.models.hf_pretrained.state import StateSource  # noqa: E402

OnBytes = Callable[[int], None]


class _Keys(list):
    """The sorted key list megatron-bridge asks for, with O(1) membership: it tests `key in keys`
    once per tensor, which is quadratic on a list for a 100k-tensor checkpoint."""

    def __init__(self, keys: Iterable[str]) -> None:
        super().__init__(keys)
        self._set = frozenset(self)

    def __contains__(self, key: object) -> bool:
        return key in self._set


class PrefetchingSource(StateSource):
    def __init__(self, checkpoint: HFCheckpoint, bucket_bytes: int, on_bytes: OnBytes | None = None,
                 fastio: bool = False) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"I/O bucket must be > 0 bytes, got {bucket_bytes}")
        self.checkpoint = checkpoint
        self.bucket_bytes = bucket_bytes
        self.on_bytes = on_bytes
        self.peak_buffered = 0
        self._keys = _Keys(sorted(checkpoint.tensors))
        self._cond = threading.Condition()
        self._ready: dict[str, torch.Tensor] = {}
        self._buffered = 0
        self._claimed: set[str] = set()
        self._reading: str | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        self.fast: DirectTensorReads | None = None
        if fastio:
            from megatron_sao.checkpointing.fastio.hf_direct import DirectTensorReads

            # the read-ahead keeps a bucket of tensors read while the conversion holds the one it took:
            # buffers coming back find the bucket full, so the pool keeps up to a second bucket's worth
            self.fast = DirectTensorReads(checkpoint, pool_bytes=2 * bucket_bytes)

    # ---- StateSource ------------------------------------------------------------------------

    def get_all_keys(self) -> list[str]:
        return self._keys

    def load_tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return {key: self._take(key) for key in keys if key in self.checkpoint.tensors}

    # ---- read-ahead -------------------------------------------------------------------------

    def start(self, order: list[str]) -> None:
        """Read `order` (the names the conversion will ask for, in its order) ahead in a thread."""
        assert self._thread is None, "read-ahead started twice"
        self._thread = threading.Thread(target=self._run, args=(list(order),), name="sao-hf-read-ahead", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._ready.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        if self.fast is not None:
            self.fast.close()

    def _take(self, key: str) -> torch.Tensor:
        with self._cond:
            while True:
                if key in self._ready:
                    tensor = self._ready.pop(key)
                    self._buffered -= self.checkpoint.tensors[key].nbytes
                    self._cond.notify_all()
                    return tensor
                if self._reading != key or self._error is not None:
                    self._claimed.add(key)  # not read ahead (yet): the thread will skip it
                    break
                self._cond.wait()
        return self._read(self.checkpoint.tensors[key])

    def _run(self, order: list[str]) -> None:
        try:
            for key in order:
                info = self.checkpoint.tensors[key]
                with self._cond:
                    self._cond.wait_for(partial(self._may_go_on, key, info.nbytes))
                    if self._stop:
                        return
                    if key in self._claimed:
                        continue
                    self._reading = key
                tensor = self._read(info)
                with self._cond:
                    self._reading = None
                    if not self._stop:
                        self._ready[key] = tensor
                        self._buffered += info.nbytes
                        self.peak_buffered = max(self.peak_buffered, self._buffered)
                    self._cond.notify_all()
        except BaseException as e:  # the consumer reads on the spot and meets the error itself
            with self._cond:
                self._error = e
                self._reading = None
                self._cond.notify_all()

    def _may_go_on(self, key: str, nbytes: int) -> bool:
        return (self._stop or key in self._claimed or self._buffered == 0
                or self._buffered + nbytes <= self.bucket_bytes)

    def _fd(self, file: str) -> int:
        with self._fd_lock:
            if file not in self._fds:
                self._fds[file] = os.open(self.checkpoint.path / file, os.O_RDONLY)
            return self._fds[file]

    def _read(self, info: TensorInfo) -> torch.Tensor:
        raw = self.fast.read(info) if self.fast is not None else None
        if raw is not None:
            if self.on_bytes is not None:
                self.on_bytes(info.nbytes)
            return raw.view(info.torch_dtype).reshape(info.shape)
        if self.fast is not None:  # a file refusing O_DIRECT: through the page cache, into the pool
            raw = self.fast.buffers.tensor(info.nbytes)
        else:
            raw = torch.empty(info.nbytes, dtype=torch.uint8)
        view = memoryview(raw.numpy())
        fd, done = self._fd(info.file), 0
        while done < info.nbytes:
            n = os.preadv(fd, [view[done:]], info.offset + done)
            if n == 0:
                raise ValueError(f"{self.checkpoint.path / info.file}: truncated while reading {info.name!r} "
                                 f"(the file changed since it was checked)")
            done += n
        if self.on_bytes is not None:
            self.on_bytes(info.nbytes)
        return raw.view(info.torch_dtype).reshape(info.shape)
