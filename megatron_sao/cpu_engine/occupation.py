"""Memory occupation as SGLang 0.5.23 has it, for the CPU engine: what `release_memory_occupation`
and `resume_memory_occupation` allow, and which misuses kill the engine.

The CPU engine frees nothing (its model lives in host memory), but the pipeline's colocated flow
must get SGLang's order right, so the CPU engine enforces the same rules
(`sglang/srt/managers/scheduler_components/weight_updater.py`, `release_memory_occupation` /
`resume_memory_occupation`):

- releasing asserts that the scheduler is idle (`is_fully_idle(ignore_waiting=paused)`: nothing
  running; waiting requests are allowed only while paused, e.g. after `pause_generation(retract)`);
  in SGLang the failed assertion is raised inside the scheduler loop, which then exits and takes
  the server down (`scheduler.py`: "Scheduler hit an exception", SIGQUIT);
- no tags (or an empty list) means every type: `GPU_MEMORY_ALL_TYPES` (`srt/constants.py`);
- resuming a tag that is not released fails in the same way (`offload_tags.remove(tag)`: KeyError);
- running a step or loading weights into released memory would touch freed device memory (with
  `--enable-memory-saver` the pages are unmapped): the CPU engine treats both as fatal too.
"""

from __future__ import annotations

from collections.abc import Iterable

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TYPES = (KV_CACHE, WEIGHTS, CUDA_GRAPH)  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES
NOT_IDLE = "release_memory_occupation should be called only when server is idle."  # 0.5.23's assertion


class EngineFatal(RuntimeError):
    """An operation that SGLang 0.5.23 answers by crashing its scheduler: the engine stops."""


class MemoryOccupation:
    """The memory types released by `release_memory_occupation` and not yet resumed."""

    def __init__(self) -> None:
        self.released: set[str] = set()

    @staticmethod
    def _tags(tags: Iterable[str] | None) -> list[str]:
        tags = list(tags or [])
        return tags or list(ALL_TYPES)

    def release(self, tags: Iterable[str] | None, idle: bool) -> list[str]:
        if not idle:
            raise EngineFatal(NOT_IDLE)
        tags = self._tags(tags)
        self.released.update(tags)
        return tags

    def resume(self, tags: Iterable[str] | None) -> list[str]:
        tags = self._tags(tags)
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise EngineFatal(f"resume_memory_occupation of {missing}, which are not released (released: "
                              f"{sorted(self.released)}): SGLang's scheduler raises KeyError here")
        self.released.difference_update(tags)
        return tags

    def check_step(self) -> None:
        """Before a generation step: the KV cache and the weights must be resident."""
        gone = sorted(self.released & {KV_CACHE, WEIGHTS})
        if gone:
            raise EngineFatal(f"a generation step with {gone} released: resume_memory_occupation before "
                              "continue_generation")

    def check_weight_load(self) -> None:
        if WEIGHTS in self.released:
            raise EngineFatal("a weight update into released weights: resume_memory_occupation(tags=['weights']) "
                              "first (SGLang would write into freed device memory)")
