"""Configuration of the Python tool sandbox (see `run.py` and docs/sandbox.md)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

MAX_PID = 4_194_304
"""The kernel's largest pid_max: sandbox uids span [uid_base, uid_base + MAX_PID)."""


@dataclass(kw_only=True, slots=True)
class SandboxConfig:
    """How sandboxes are built. One instance is typically shared by all trajectories."""

    python: str = sys.executable
    """Interpreter for the model's code. The default (the trainer's own, with its packages:
    sympy, numpy) works because its install is re-exposed read-only inside the mount namespace
    even when it lives under a masked home directory."""
    python_args: tuple[str, ...] = ("-E", "-s", "-B", "-u")
    """Unbuffered (-u) so output written before a crash or timeout is not lost."""
    max_output_bytes: int = 16_384
    """stdout+stderr kept for the model; producing more stops the program (an error result)."""
    max_processes: int = 16
    """RLIMIT_NPROC for the private uid: tasks (threads count) the code may have at once."""
    max_open_files: int = 256
    scratch_mb: int = 64
    """Size of the private tmpfs at /tmp (the cwd), also the largest file the code may write."""
    max_code_bytes: int = 1_000_000
    scratch_root: str | None = None
    """Where the host-side scratch directory of each call is made (None: the system temp dir).
    Used as the code's cwd only when the mount namespace is unavailable; always removed."""
    cpu_time_s: float | None = None
    """RLIMIT_CPU per process; None = the call's timeout_s + 1 s (a busy loop hits the wall clock
    first, and is reported as the timeout it is, even with a whole core to itself)."""
    namespaces: tuple[str, ...] = ("net", "mount", "pid")
    drop_privileges: bool = True
    """Run the code as uid `uid_base + supervisor pid` (unique while the sandbox lives)."""
    uid_base: int = 2_000_000_000
    masked_paths: tuple[str, ...] = ("/root", "/home", "/run")
    """Replaced by an empty read-only tmpfs inside the sandbox (secrets, sockets)."""
    strict: bool = False
    """Refuse to run (error result) when any isolation primitive is unavailable."""
    env: dict[str, str] = field(default_factory=lambda: {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    })
    """The complete environment of the code (plus HOME and TMPDIR = the scratch): nothing of
    the caller's environment (tokens, proxies) is passed on."""

    def __post_init__(self) -> None:
        for name in ("max_output_bytes", "max_processes", "max_open_files", "scratch_mb", "max_code_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be positive, got {getattr(self, name)}")
        if not 1000 <= self.uid_base <= 2**32 - 2 - MAX_PID:
            raise ValueError(f"SandboxConfig.uid_base must be in [1000, {2**32 - 2 - MAX_PID}], got {self.uid_base}")
        unknown = set(self.namespaces) - {"net", "mount", "pid"}
        if unknown:
            raise ValueError(f"SandboxConfig.namespaces: unknown {sorted(unknown)}; use net, mount, pid")
