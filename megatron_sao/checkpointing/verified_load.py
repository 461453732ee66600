"""mcore-to-hf's load: the checkpoint loading into the model in the background while the export
reads each parameter as it completes, with the manifest's checksums verified beside it (see
`mcore_to_hf`).

Each rank verifies a share of the files (`manifest.checksum_share`). On the standard path a thread
hashes the share while the load reads the files through torch's `FileSystemReader`. With fast I/O
(`fastio=True`) the load hashes its share in the same pass that reads it (`fastio.distcp_stream`),
gives each exported parameter's pages back to the OS (`fastio.page_release`) and is held at most a
window ahead of the export (`fastio.load_window`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_sao.checkpointing.digest import digest_file
from megatron_sao.checkpointing.fill_tracker import FillTracker
from megatron_sao.checkpointing.hf_load import float_state
from megatron_sao.checkpointing.io_bucket import DEFAULT_IO_BUCKET_BYTES
from megatron_sao.checkpointing.manifest import Manifest, checksum_errors, checksum_share
from megatron_sao.checkpointing.mcore_io import start_load_model
from megatron_sao.checkpointing.progress import Progress
from megatron_sao.platform.collective import any_rank_flags, raise_if_any, rank
from megatron_sao.platform.collective import world_size as get_world_size

if TYPE_CHECKING:
    from megatron_sao.checkpointing.dist_reader import BackgroundLoad
    from megatron_sao.checkpointing.fastio.distcp_reader import FastLoad
    from megatron_sao.checkpointing.fastio.load_window import LoadWindow


def _hash_files(directory: Path, names: list[str], algorithm: str) -> dict[str, str]:
    return {name: digest_file(directory / name, algorithm) for name in names}


class VerifiedLoad:
    """Collective: the checkpoint loading into `chunks` (in the background where it can:
    `mcore_io.start_load_model`), this rank's share of the files hashed beside it. `wait_for` blocks
    until a parameter is loaded (or the load ended, even in failure: the export's gathers must run
    on every rank); `finish` raises on every rank if any checksum differs or any rank's load failed."""

    def __init__(self, mcore_dir: Path, manifest: Manifest | None, chunks: list[torch.nn.Module], progress: Progress,
                 *, fastio: bool = False, window_bytes: int = DEFAULT_IO_BUCKET_BYTES) -> None:
        """`manifest`: the checkpoint's, whose checksums are verified (None: none are). With
        `fastio`, the load is held at most `window_bytes` ahead of what `give_back` returned."""
        self.mcore, self.manifest = Path(mcore_dir), manifest
        self.released_bytes = 0
        self.share: list[str] = []
        """The manifest's files this rank verifies."""
        self._errors: list[str] | None = None
        self._hashing: Future[dict[str, str]] | None = None
        self.fast: FastLoad | None = None
        if fastio:
            from megatron_sao.checkpointing.fastio.distcp_items import saving_rank
            from megatron_sao.checkpointing.fastio.distcp_reader import FastLoad
            from megatron_sao.checkpointing.fastio.distcp_stream import FileDigests
            from megatron_sao.checkpointing.fastio.load_window import LoadWindow

            if manifest is not None:
                self.share = checksum_share(manifest, rank(), get_world_size(), saved_by=saving_rank)
            self.fast = FastLoad(window=LoadWindow(window_bytes),
                                 digests=FileDigests({name: manifest.digest for name in self.share})
                                 if manifest is not None else None)
        elif manifest is not None:
            self.share = checksum_share(manifest, rank(), get_world_size())
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sao-checksum")
            self._hashing = pool.submit(_hash_files, self.mcore, self.share, manifest.digest)
            pool.shutdown(wait=False)  # the thread runs beside the load; `checksum_errors` waits for it
        self.tracker = FillTracker(tensor for _, tensor in float_state(chunks, ()))
        self.background: BackgroundLoad | None = None
        self.failure: BaseException | None = None
        try:
            self.background = start_load_model(chunks, self.mcore, on_bytes=progress.advance, tracker=self.tracker,
                                               fast=self.fast)
        except (Exception, CheckpointException) as e:  # a corrupt file may fail the load: its checksum error says why
            self.failure = e
        self.loaded_at = time.monotonic()
        if self._any_rank_failed():  # before the export: a rank without its weights must not gather
            self._raise()

    @property
    def window(self) -> LoadWindow | None:
        return self.fast.window if self.fast is not None else None

    @property
    def hashed_while_loading(self) -> int:
        """Files of the share the load hashed in its own pass (fast I/O; 0 on the standard path)."""
        return len(self.fast.digests.found) if self.fast is not None and self.fast.digests is not None else 0

    def wait_for(self, parameter: torch.Tensor) -> None:
        """Block until `parameter` is loaded (the load is not held back meanwhile)."""
        if self.window is None:
            self.tracker.wait(parameter)
            return
        with self.window.consumer_waiting():
            self.tracker.wait(parameter)

    def give_back(self, parameter: torch.Tensor) -> None:
        """Fast I/O: `parameter` is exported and never read again: its pages go back to the OS, and
        the load may run that much further ahead."""
        from megatron_sao.checkpointing.fastio.page_release import release_pages

        span = self.tracker.span(parameter) if parameter.numel() else None
        if span is None:
            return
        address, nbytes = self.tracker.extent(span)
        self.released_bytes += release_pages(address, nbytes)
        if self.window is not None:
            self.window.given_back(nbytes)

    def close_window(self) -> None:
        """Nothing more will be given back (the export ended, or gives nothing back): the load must
        not wait for it."""
        if self.window is not None:
            self.window.close()

    def checksum_errors(self) -> list[str]:
        """This rank's share: digests computed beside the load (or, with fast I/O, by it), and those
        of files it did not read whole (its pass failed, or it never ran) computed now."""
        if self._errors is None:
            if self.manifest is None:
                self._errors = []
            else:
                try:
                    if self._hashing is not None:
                        known = self._hashing.result()
                    else:
                        known = self.fast.digests.found if self.fast is not None and self.fast.digests else {}
                    self._errors = checksum_errors(self.mcore, self.manifest, self.share, known=known)
                except OSError as e:  # e.g. a file removed while converting
                    self._errors = [f"{self.mcore}: cannot verify checksums: {e}"]
        return self._errors

    def _any_rank_failed(self) -> bool:
        return bool(any_rank_flags(torch.tensor([int(self.failure is not None)], dtype=torch.int32)).item())

    def _raise(self) -> None:
        self.close_window()  # a background load held back by it must run to its end
        raise_if_any(self.checksum_errors())
        if self.failure is not None:
            raise self.failure
        raise RuntimeError(f"loading {self.mcore} failed on another rank (its log has the error)")

    def finish(self) -> None:
        if self.background is not None:
            try:
                self.background.join()
            except (Exception, CheckpointException) as e:  # torch.distributed.checkpoint's is a BaseException
                self.failure = e
            self.loaded_at = self.background.finished_at or time.monotonic()
        raise_if_any(self.checksum_errors())
        if self._any_rank_failed():
            self._raise()
