"""Save and load a model's weights as a torch_dist checkpoint under `keys.model_state`'s keys, with
memory bounded by the shard plus the I/O bucket (what conversion and `verify` use).

`save_model` writes through `dist_writer.BoundedSaveStrategy` (Megatron's plan and files, each
tensor staged only just before it is written, hashed as written), `load_model` /
`start_load_model` load in place (`dist_reader.merge_in_place`), optionally in the background
while the caller reads each parameter as it completes. Training loads through Megatron's standard
`dist_checkpointing.load` with the same keys (`training/checkpoint/weights.py`); the result is the
same tensors either way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_sao.checkpointing.fill_tracker import FillTracker
from megatron_sao.checkpointing.io_bucket import DEFAULT_IO_BUCKET_BYTES
from megatron_sao.checkpointing.keys import model_state

if TYPE_CHECKING:
    from megatron_sao.checkpointing.dist_reader import BackgroundLoad
    from megatron_sao.checkpointing.fastio.distcp_reader import FastLoad

OnBytes = Callable[[int], None]


def save_model(chunks: list[torch.nn.Module], directory: Path, thread_count: int = 2,
               bucket_bytes: int = DEFAULT_IO_BUCKET_BYTES, on_bytes: OnBytes | None = None,
               on_planned: OnBytes | None = None, fill: Callable[[], None] | None = None,
               tracker: FillTracker | None = None, fastio: bool = False) -> dict[str, tuple[int, str]]:
    """Collective: write the chunks' weights as a torch_dist checkpoint into existing `directory`.

    `thread_count` writer threads per rank (each writes and hashes one file; 2 overlap hashing and
    serialising with the disk on a 2-core host); at most `bucket_bytes` of staged copies at a time
    (`dist_writer`); `on_planned(bytes this rank writes)`, then `on_bytes(n)` per tensor written.
    With `fill` (and the `tracker` it reports to), the weights are written while `fill` fills them:
    `fill` runs on this thread after the save is planned (see `dist_writer`). With `fastio`, the
    files are written past the page cache where the filesystem allows (`fastio.direct_io`) and,
    given a tracker, each tracked tensor's memory goes back to the OS once written
    (`fastio.page_release`): the chunks' weights read as zeros afterwards.
    Returns {file name: (bytes, digest hex)} of the .distcp files this rank wrote."""
    from megatron.core import dist_checkpointing

    from megatron_sao.checkpointing.dist_writer import BoundedSaveStrategy

    strategy = BoundedSaveStrategy(thread_count=thread_count, bucket_bytes=bucket_bytes, on_bytes=on_bytes,
                                   on_planned=on_planned, fill=fill, tracker=tracker, fastio=fastio)
    dist_checkpointing.save(model_state(chunks), str(directory), sharded_strategy=strategy)
    return strategy.files


def load_model(chunks: list[torch.nn.Module], directory: Path, on_bytes: OnBytes | None = None) -> None:
    """Collective: load weights saved by `save_model` (any layout, either spec) into `chunks`, in
    place (no second copy of any tensor; `dist_reader.merge_in_place`); `on_bytes(n)` per tensor read."""
    start_load_model(chunks, directory, on_bytes)


def start_load_model(chunks: list[torch.nn.Module], directory: Path, on_bytes: OnBytes | None = None,
                     tracker: FillTracker | None = None, fast: FastLoad | None = None) -> BackgroundLoad | None:
    """Collective: `load_model`; with `tracker` (over the chunks' tensors), the reading goes on in
    the background after every collective has run, each tensor marked in `tracker` once loaded,
    and the running load is returned (`join` it; it finishes the tracker either way). Returns
    None when the load is complete on return (no tracker, or the loaded state is not the chunks'
    own tensors: then the tracker is finished too). The files are read by torch's `FileSystemReader`,
    or with `fast` (the fast-I/O path) by `fastio.distcp_reader.ParallelFileReader`: a background
    load held back by `fast.window`, the files `fast.digests` wants hashed as they are read, each in
    one pass (a file whose pass did not complete, the load having failed, has no digest in
    `fast.digests.found`)."""
    from megatron.core import dist_checkpointing

    from megatron_sao.checkpointing.dist_reader import CountingLoadStrategy, merge_in_place

    state = model_state(chunks)
    for chunk_state in state.values():
        merge_in_place(chunk_state, tracker)
    strategy = CountingLoadStrategy(on_bytes, tracker=tracker, fast=fast)
    loaded = dist_checkpointing.load(state, str(directory), sharded_strategy=strategy)
    background = strategy.background
    if background is not None and all(_is_own_state(chunk, loaded[key]) for key, chunk in zip(state, chunks,
                                                                                              strict=True)):
        for key, chunk in zip(state, chunks, strict=True):  # the objects: what load_state_dict would set
            chunk.load_state_dict({k: v for k, v in loaded[key].items() if not isinstance(v, torch.Tensor)},
                                  strict=False)
        return background
    if background is not None:
        background.join()
    for key, chunk in zip(state, chunks, strict=True):
        chunk.load_state_dict(loaded[key], strict=True)
    if tracker is not None:
        tracker.finish()
    return None


def _is_own_state(chunk: torch.nn.Module, loaded: dict[str, Any]) -> bool:
    """Whether `loaded` holds exactly the chunk's state tensors themselves (loaded in place), so
    `load_state_dict` would copy each onto itself, plus `_extra_state` objects."""
    own = chunk.state_dict(keep_vars=True)
    if not loaded.keys() <= own.keys() or any(not k.endswith("_extra_state") for k in own.keys() - loaded.keys()):
        return False  # (an `_extra_state` the checkpoint does not hold is what load_state_dict accepts too)
    for key, value in loaded.items():
        if not isinstance(value, torch.Tensor):
            if not key.endswith("_extra_state"):
                return False
        elif not (isinstance(own[key], torch.Tensor) and value.data_ptr() == own[key].data_ptr()
                  and value.shape == own[key].shape and value.dtype == own[key].dtype):
            return False
    return True


def tensor_table(directory: Path) -> dict[str, dict[str, Any]]:
    """{key: {dtype, shape}} of the tensors stored in a torch_dist checkpoint (global shapes)."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(str(directory))
    return {key: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.global_shape)}
            for key, t in sorted(metadata.items())}
