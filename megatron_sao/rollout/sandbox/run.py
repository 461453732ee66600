"""Python tool sandbox: run model-written code in an isolated, limited, short-lived process.

What one call does (details and limits in docs/sandbox.md): a fresh process tree in new network,
mount and PID namespaces; the code runs as a private unprivileged uid with no_new_privs, with
RLIMIT_AS / CPU / NPROC / FSIZE / NOFILE limits, a scrubbed environment, stdin from /dev/null,
every filesystem read-only except a private size-limited tmpfs on /tmp (its cwd), home
directories masked, no network at all (not even loopback). The wall clock is enforced by the
supervisor and, as a backstop, by this process; output beyond `max_output_bytes` stops the
program. When the call returns, every process it started is dead. Failures come back as a
`SandboxResult` with `ok=False` and a reason: nothing here raises for anything the code does.

Where a primitive is unavailable (no root, a container that forbids unshare) the call degrades
and logs one warning per missing primitive saying what is no longer protected; `strict=True`
refuses to run instead. The privileged half lives in `init.py` (run as a script); the
configuration in `config.py`; the async pool in `pool.py`; the package re-exports all three's names.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_sao.rollout.sandbox.config import SandboxConfig
from megatron_sao.utils.lifetime import RUN_ID_ENV, run_id

logger = logging.getLogger(__package__)  # megatron_sao.rollout.sandbox, as before it was a package

__all__ = ["SandboxConfig", "SandboxResult", "run_python"]

_INIT_SCRIPT = str(Path(__file__).with_name("init.py"))  # run by path, with -I -S: never imported
_MEANING_OF_MISSING = {
    "net": "model code CAN reach the network",
    "mount": "the filesystem is NOT read-only and home directories are NOT hidden; the code can "
             "write wherever its uid may",
    "pid": "processes that leave the process group may outlive the call unless the uid sweep "
           "(root only) catches them",
    "user": "the code runs with the caller's uid (and privileges); RLIMIT_NPROC is not applied",
}
_BACKSTOP_GRACE_S = 5.0  # the supervisor stops the code at timeout_s; this is if it cannot
_DRAIN_AFTER_EXIT_S = 1.0  # an escaped process holding the pipe must not hang the call


@dataclass(slots=True)
class SandboxResult:
    """Outcome of one run. `output` is what the model should see (merged stdout+stderr)."""

    ok: bool
    output: str
    timed_out: bool = False
    error: str | None = None
    """Why not ok: timeout, memory, CPU, signal, non-zero exit, output limit, setup failure."""
    exit_code: int | None = None
    signal: int | None = None
    output_truncated: bool = False
    duration_s: float = 0.0
    isolation: tuple[str, ...] = ()
    """Primitives that were in force: a subset of net, mount, pid, user."""


_warned: set[str] = set()
_warned_lock = threading.Lock()
_interpreter_dirs: dict[str, tuple[str, ...]] = {}


def _warn_missing(missing: dict[str, str]) -> None:
    with _warned_lock:
        for name, reason in missing.items():
            if name not in _warned:
                _warned.add(name)
                logger.warning("sandbox: %s isolation unavailable (%s): %s", name, reason,
                               _MEANING_OF_MISSING.get(name, ""))


def _interpreter_paths(python: str) -> tuple[str, ...]:
    """Install directories of `python`, so masked home directories can re-expose them."""
    cached = _interpreter_dirs.get(python)
    if cached is not None:
        return cached
    probe = ("import sys,json;"
             "print(json.dumps([sys.prefix,sys.base_prefix,sys.exec_prefix,sys.base_exec_prefix]))")
    try:
        if os.path.realpath(python) == os.path.realpath(sys.executable):
            dirs = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
        else:
            out = subprocess.run([python, "-E", "-s", "-c", probe], capture_output=True, timeout=30,
                                 check=True)
            dirs = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        logger.warning("sandbox: could not inspect interpreter %r (%s); not re-exposing its install",
                       python, e)
        dirs = []
    dirs.append(os.path.dirname(os.path.realpath(python)))
    resolved = tuple(sorted({os.path.realpath(d) for d in dirs}))
    _interpreter_dirs[python] = resolved
    return resolved


def _failure(error: str, start: float) -> SandboxResult:
    return SandboxResult(ok=False, output="", error=error, duration_s=time.monotonic() - start)


def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 1024, *,
               config: SandboxConfig | None = None) -> SandboxResult:
    """Run `code` as a script in a fresh sandbox and wait for it (thread-safe, blocking).

    `timeout_s` is wall clock for the whole program, interpreter start-up and imports included;
    `memory_mb` is the address-space limit of each of its processes.
    """
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(f"run_python: timeout_s and memory_mb must be positive, "
                         f"got {timeout_s}, {memory_mb}")
    cfg = config or SandboxConfig()
    start = time.monotonic()
    code_bytes = len(code.encode("utf-8", errors="replace"))
    if code_bytes > cfg.max_code_bytes:
        return _failure(f"code is {code_bytes} bytes, over the {cfg.max_code_bytes}-byte limit", start)
    try:
        host_scratch = tempfile.mkdtemp(prefix="sao-sandbox-", dir=cfg.scratch_root)
    except OSError as e:
        return _failure(f"sandbox setup failed: cannot create a scratch directory in {cfg.scratch_root}: {e}", start)
    spec = {
        "code": code, "timeout_s": timeout_s, "memory_mb": memory_mb,
        # Default CPU limit one second past the wall clock: a busy loop on a free core accrues CPU
        # time as fast as wall time, and must end as the timeout it is, not as SIGXCPU.
        "cpu_time_s": cfg.cpu_time_s or timeout_s + 1.0, "python": cfg.python,
        "python_args": list(cfg.python_args), "namespaces": list(cfg.namespaces),
        "drop_privileges": cfg.drop_privileges, "uid_base": cfg.uid_base, "strict": cfg.strict,
        "max_processes": cfg.max_processes, "max_open_files": cfg.max_open_files,
        "scratch_mb": cfg.scratch_mb, "host_scratch": host_scratch, "env": cfg.env,
        "masked_paths": [os.path.realpath(p) for p in cfg.masked_paths],
        "exposed_paths": list(_interpreter_paths(cfg.python)),
    }
    try:
        proc = subprocess.Popen(  # the supervisor stops the sandbox when this process ends (its argument)
            [sys.executable, "-I", "-S", "-B", _INIT_SCRIPT, str(os.getpid())], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, cwd="/",
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", RUN_ID_ENV: run_id()},
        )
    except OSError as e:
        shutil.rmtree(host_scratch, ignore_errors=True)
        return _failure(f"sandbox setup failed: could not start the supervisor: {e}", start)
    try:
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(spec).encode("utf-8", errors="surrogatepass"))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the supervisor died at once; its stderr says why
        backstop_at = start + timeout_s + _BACKSTOP_GRACE_S
        output, status, truncated, backstop = _collect(proc, cfg.max_output_bytes, backstop_at)
    finally:
        _kill_group(proc.pid)
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        shutil.rmtree(host_scratch, ignore_errors=True)
    if status.get("missing"):
        _warn_missing(status["missing"])
    return _classify(output, status, truncated, backstop, timeout_s, memory_mb, cfg, start)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _collect(proc: subprocess.Popen, max_output: int, backstop_at: float) -> tuple[bytes, dict, bool, bool]:
    """Read output and status until both pipes close; stop the program on too much output."""
    assert proc.stdout is not None and proc.stderr is not None
    output, status_buf = bytearray(), bytearray()
    truncated = backstop = False
    exited_at: float | None = None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(proc.stderr, selectors.EVENT_READ, "status")
        while sel.get_map():
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if now >= backstop_at or (exited_at is not None and now - exited_at > _DRAIN_AFTER_EXIT_S):
                backstop = now >= backstop_at
                break
            for key, _ in sel.select(timeout=0.1):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data == "status":
                    status_buf += chunk
                elif not truncated:
                    output += chunk
                    if len(output) > max_output:
                        truncated = True
                        del output[max_output:]
                        with contextlib.suppress(ProcessLookupError):
                            proc.send_signal(signal.SIGTERM)  # the supervisor kills the sandbox
    status: dict = {"raw": []}
    for line in status_buf.decode("utf-8", errors="replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        if isinstance(item, dict):
            missing = {**status.get("missing", {}), **item.pop("missing", {})}
            status.update(item)
            status["missing"] = missing
        elif line.strip():
            status["raw"].append(line)
    return bytes(output), status, truncated, backstop


def _classify(output: bytes, status: dict, truncated: bool, backstop: bool, timeout_s: float,
              memory_mb: int, cfg: SandboxConfig, start: float) -> SandboxResult:
    text = output.decode("utf-8", errors="replace")
    if truncated:
        text += f"\n... [output truncated at {cfg.max_output_bytes} bytes]"
    exit_code, sig = status.get("exit_code"), status.get("signal")
    # The program's own exit status means it finished: a deadline that passed during teardown
    # (I reported, S had not yet reaped it) is not the program's timeout.
    finished = exit_code is not None or sig is not None
    timed_out = (bool(status.get("timed_out")) and not finished) or backstop
    error: str | None = None
    if status.get("setup_error"):
        error = f"sandbox setup failed: {status['setup_error']}"
    elif timed_out:
        error = f"timed out after {timeout_s:g} s"
    elif truncated:
        error = f"output limit exceeded ({cfg.max_output_bytes} bytes); the program was stopped"
    elif not status.get("done") or (exit_code is None and sig is None):
        detail = " | ".join(status["raw"][-5:]) or "no status from the supervisor"
        error = f"sandbox setup failed: {detail}"
    elif sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        error = "CPU time limit exceeded" if sig == signal.SIGXCPU else f"killed by signal {name}"
    elif exit_code == 127 and "sandbox: could not start the program" in text:
        error = "sandbox setup failed: " + text.strip().splitlines()[-1]
    elif exit_code != 0:
        tail = text[-2000:]
        if "MemoryError" in tail or "Cannot allocate memory" in tail:
            error = f"memory limit exceeded ({memory_mb} MB)"
        else:
            error = f"exited with status {exit_code}"
    return SandboxResult(
        ok=error is None, output=text, timed_out=timed_out, error=error, exit_code=exit_code,
        signal=sig, output_truncated=truncated, duration_s=time.monotonic() - start,
        isolation=tuple(i for i in status.get("isolation", ()) if i not in status.get("missing", {})),
    )
