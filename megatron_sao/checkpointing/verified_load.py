"""mcore-to-hf's load: the checkpoint loading into the model in the background while the export
reads each parameter as it completes, the manifest's checksums verified in the same pass, and each
exported parameter's memory given back (see `mcore_to_hf`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_sao.checkpointing.distcp_items import saving_rank
from megatron_sao.checkpointing.distcp_stream import FileDigests
from megatron_sao.checkpointing.fill_tracker import FillTracker
from megatron_sao.checkpointing.hf_load import float_state
from megatron_sao.checkpointing.load_window import LoadWindow
from megatron_sao.checkpointing.manifest import Manifest, checksum_errors, checksum_share
from megatron_sao.checkpointing.mcore_io import start_load_model
from megatron_sao.checkpointing.page_release import release_pages
from megatron_sao.checkpointing.progress import Progress
from megatron_sao.platform.collective import any_rank_flags, raise_if_any, rank
from megatron_sao.platform.collective import world_size as get_world_size

if TYPE_CHECKING:
    from megatron_sao.checkpointing.dist_reader import BackgroundLoad


class VerifiedLoad:
    """Collective: the checkpoint loading into `chunks` (in the background where it can:
    `mcore_io.start_load_model`), hashing this rank's share of the files as it reads them (each in
    one pass: `distcp_stream`). `wait_for` blocks until a parameter is loaded (or the load ended,
    even in failure: the export's gathers must run on every rank); `finish` raises on every rank if
    any checksum differs or any rank's load failed."""

    def __init__(self, mcore_dir: Path, manifest: Manifest | None, chunks: list[torch.nn.Module], progress: Progress,
                 window: LoadWindow | None = None) -> None:
        """`manifest`: the checkpoint's, whose checksums are verified (None: none are)."""
        self.mcore, self.manifest = Path(mcore_dir), manifest
        self.window = window
        self.released_bytes = 0
        self.digests: FileDigests | None = None
        if self.manifest is not None:
            share = checksum_share(self.manifest, rank(), get_world_size(), saved_by=saving_rank)
            self.digests = FileDigests({name: self.manifest.digest for name in share})
        self._errors: list[str] | None = None
        self.tracker = FillTracker(tensor for _, tensor in float_state(chunks, ()))
        self.background: BackgroundLoad | None = None
        self.failure: BaseException | None = None
        try:
            self.background = start_load_model(chunks, self.mcore, on_bytes=progress.advance, tracker=self.tracker,
                                               window=window, digests=self.digests)
        except (Exception, CheckpointException) as e:  # a corrupt file may fail the load: its checksum error says why
            self.failure = e
        self.loaded_at = time.monotonic()
        if self._any_rank_failed():  # before the export: a rank without its weights must not gather
            self._raise()

    def wait_for(self, parameter: torch.Tensor) -> None:
        """Block until `parameter` is loaded (the load is not held back meanwhile)."""
        if self.window is None:
            self.tracker.wait(parameter)
            return
        with self.window.consumer_waiting():
            self.tracker.wait(parameter)

    def give_back(self, parameter: torch.Tensor) -> None:
        """`parameter` is exported and never read again: its pages go back to the OS, and the load
        may run that much further ahead."""
        span = self.tracker.span(parameter) if parameter.numel() else None
        if span is None:
            return
        address, nbytes = self.tracker.extent(span)
        self.released_bytes += release_pages(address, nbytes)
        if self.window is not None:
            self.window.given_back(nbytes)

    def checksum_errors(self) -> list[str]:
        """This rank's share: the digests the load computed, and those of files it did not read
        whole (its pass failed, or it never ran) computed now."""
        if self._errors is None:
            if self.digests is None or self.manifest is None:
                self._errors = []
            else:
                try:
                    self._errors = checksum_errors(self.mcore, self.manifest, list(self.digests.wanted),
                                                   known=self.digests.found)
                except OSError as e:  # e.g. a file removed while converting
                    self._errors = [f"{self.mcore}: cannot verify checksums: {e}"]
        return self._errors

    def _any_rank_failed(self) -> bool:
        return bool(any_rank_flags(torch.tensor([int(self.failure is not None)], dtype=torch.int32)).item())

    def _raise(self) -> None:
        if self.window is not None:
            self.window.close()  # a background load held back by it must run to its end
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
