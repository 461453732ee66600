"""Async access to the Python sandbox for the agent loop.

Each sandbox call blocks a thread for its lifetime (it waits on pipes and a child), so the
async API hands calls to a bounded thread pool: `max_concurrency` bounds how many sandboxes
exist at once across all trajectories, which is what bounds their CPU and memory use. A
cancelled await does not cut a call short: the sandbox still ends by its own timeout.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from megatron_sao.rollout.sandbox.run import SandboxConfig, SandboxResult, run_python


class SandboxPool:
    """Runs sandboxes for many concurrent trajectories; share one per process."""

    def __init__(self, config: SandboxConfig | None = None, max_concurrency: int | None = None) -> None:
        if max_concurrency is not None and max_concurrency <= 0:
            raise ValueError(f"SandboxPool: max_concurrency must be positive, got {max_concurrency}")
        self.config = config or SandboxConfig()
        self.max_concurrency = max_concurrency or max(4, os.cpu_count() or 1)
        self._executor = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="sao-sandbox")

    async def run(self, code: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> SandboxResult:
        """`run_python` without blocking the event loop."""
        call = functools.partial(run_python, code, timeout_s, memory_mb, config=self.config)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        """Wait for the calls in flight (each bounded by its timeout) and stop the threads."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default_pool: SandboxPool | None = None
_default_lock = threading.Lock()


def default_pool() -> SandboxPool:
    """The process-wide pool behind `run_python_async` (default config), made on first use."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = SandboxPool()
        return _default_pool


async def run_python_async(code: str, timeout_s: float = 10.0, memory_mb: int = 1024, *,
                           pool: SandboxPool | None = None) -> SandboxResult:
    """Async `run_python` through `pool` (default: the shared default pool)."""
    return await (pool or default_pool()).run(code, timeout_s, memory_mb)
