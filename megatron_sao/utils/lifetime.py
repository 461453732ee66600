"""No process a run starts outlives the run: the one mechanism every starter uses.

A run ends in one of five ways: it finishes, a rank raises, the driver gets SIGTERM, the driver is
SIGKILLed, one rank is SIGKILLed. The last two leave no code of the dead process to clean up, so
every child notices its parent's death itself, and takes its own children along:

- `start_child(cmd)`: a child in a session of its own (one process group: `stop_groups` ends its
  whole tree, e.g. SGLang's scheduler and detokenizer processes), tagged with the run id. A program
  of ours (the CPU engine) calls `die_with_parent()` at start; any other program (SGLang's server,
  an agent scaffold) runs under a keeper: this file run as a script (standard library only, a few
  MB), which ends its group when the starter ends, and otherwise waits for the program, ends
  what it left in the group, and exits as it did.
- `die_with_parent(parent_pid)`: a thread that waits on a pidfd of the parent and ends this
  process's group when the parent is gone (SIGTERM, `grace_s`, then SIGKILL).
- `lead_process_group()`: this process (a trainer rank) leads a process group that a keeper ends
  when this process ends, however it ends: helpers libraries start and never stop when their
  parent is killed go with it (Megatron's torch_dist writer starts a multiprocessing Manager server
  per rank, `megatron/core/dist_checkpointing/strategies/filesystem_async.py`
  `get_write_results_queue`).
- `reap_with_this_process(roots)`: a keeper that tracks processes and their descendants and
  SIGKILLs them when this process ends, for a library whose own watch is slow (a local Ray
  instance: its dashboard and runtime-env agents notice the raylet's death but then wait up to
  60 s to report it to the dead GCS, `ray/_private/process_watcher.py` `report_raylet_error_logs`).
- `run_id()`: SAO_RUN_ID, set once in the driver and inherited by every process of the run (Ray's
  too), so that `grep -l SAO_RUN_ID=<id> /proc/*/environ` finds them.

Why a pidfd and not `prctl(PR_SET_PDEATHSIG)`: the kernel sends the death signal when the *thread*
that created the child exits, not its process; engines are (re)started from the supervisor's
monitor thread, which `stop()` ends first, and from worker threads that come and go. A pidfd
names the process. PDEATHSIG is used only where the creating thread provably outlives the child:
the keeper's program (the keeper has one thread) and the sandbox supervisor (the thread that
starts it waits for it). Where `os.pidfd_open` is missing (Linux < 5.3, some seccomp profiles) the
watch polls `os.getppid()` every 0.5 s instead.

Signal the group, not the keeper: a keeper ignores SIGTERM / SIGINT / SIGHUP while its program
runs (a `killpg` reaches both; the keeper must outlive its program so that the program's graceful
shutdown is not cut short by its PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

RUN_ID_ENV = "SAO_RUN_ID"
"""Environment variable naming the run every process of a run belongs to."""
PARENT_PID_ENV = "SAO_PARENT_PID"
"""Set by `start_child` for programs that call `die_with_parent()`: the pid to die with."""
DEFAULT_GRACE_S = 5.0
"""Between SIGTERM and SIGKILL when a parent is gone (the CPU engine stops in about one second)."""
KEEPER = os.path.abspath(__file__)
_POLL_S = 0.5  # without pidfds
_TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_group_keeper: subprocess.Popen | None = None
_reapers: list[subprocess.Popen] = []


def run_id() -> str:
    """This run's id: SAO_RUN_ID, set in this process's environment on first use so that every
    process started from here on inherits it."""
    value = os.environ.get(RUN_ID_ENV)
    if not value:
        value = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.environ[RUN_ID_ENV] = value
    return value


# ---- starting children ---------------------------------------------------------------------------

def keeper_command(cmd: Sequence[str], grace_s: float = DEFAULT_GRACE_S) -> list[str]:
    """`cmd` under a keeper that ends its process group when this process ends (for programs that
    do not call `die_with_parent` themselves). Start it in a new session (`start_child` does)."""
    return [sys.executable, "-I", "-S", "-B", KEEPER, "--parent", str(os.getpid()), "--grace", f"{grace_s:g}",
            "--", *cmd]


def start_child(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, watches_parent: bool = False,
                grace_s: float = DEFAULT_GRACE_S, **popen: Any) -> subprocess.Popen:
    """Start `cmd` as a child that ends when this process ends: in a session of its own, with the
    run id in its environment. `watches_parent`: the program calls `die_with_parent()` itself (it
    finds this process's pid in SAO_PARENT_PID); otherwise it runs under a keeper. The returned
    process's pid is the group's id (`stop_groups`, `os.killpg`)."""
    child_env = dict(os.environ if env is None else env)
    child_env[RUN_ID_ENV] = run_id()
    if watches_parent:
        child_env[PARENT_PID_ENV] = str(os.getpid())
        argv = list(cmd)
    else:
        child_env.pop(PARENT_PID_ENV, None)
        argv = keeper_command(cmd, grace_s)
    return subprocess.Popen(argv, env=child_env, start_new_session=True, **popen)


def stop_groups(processes: Sequence[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM to the process group of each of `processes` (children from `start_child`), up to
    `timeout_s` for them to exit, then SIGKILL to every group. A group is signalled even when its
    leader has exited: its members may remain."""
    for process in processes:
        _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# ---- a child's side --------------------------------------------------------------------------------

def die_with_parent(parent_pid: int | None = None, grace_s: float = DEFAULT_GRACE_S) -> bool:
    """End this process, and the process group it leads, when process `parent_pid` (this process's
    parent) ends: SIGTERM to the group (this process's own handlers run), then SIGKILL after
    `grace_s` (0: SIGKILL at once). `parent_pid` None: SAO_PARENT_PID (`start_child` sets it; it is
    removed here so that this process's children do not take it for theirs), and nothing is done
    when it is absent (a program started by hand). Returns whether the watch is in place."""
    if parent_pid is None:
        value = os.environ.pop(PARENT_PID_ENV, "")
        if not value:
            return False
        parent_pid = int(value)
    fd = _pidfd(parent_pid)  # opened before the check below, so it cannot name a reused pid
    if os.getppid() != parent_pid:  # gone before we got here
        _say(f"parent process {parent_pid} ended before process {os.getpid()} started; exiting")
        _end_own_group(0.0)
    threading.Thread(target=_watch_parent, args=(parent_pid, fd, grace_s), name="die-with-parent",
                     daemon=True).start()
    return True


def _watch_parent(parent_pid: int, fd: int | None, grace_s: float) -> None:
    while os.getppid() == parent_pid:
        if fd is not None and _wait_readable([fd], None):
            break
        if fd is None:
            time.sleep(_POLL_S)
    _say(f"parent process {parent_pid} ended; stopping process {os.getpid()}")
    _end_own_group(grace_s)


def _end_own_group(grace_s: float) -> None:
    """SIGTERM, `grace_s`, SIGKILL: to this process's group when it leads one, else to itself only
    (never to a group this process merely belongs to: that may be the driver's shell's)."""
    leader = os.getpgid(0) == os.getpid()

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if leader:
                os.killpg(0, sig)
            else:
                os.kill(os.getpid(), sig)

    if grace_s > 0:
        send(signal.SIGTERM)
        time.sleep(grace_s)
    send(signal.SIGKILL)


def lead_process_group() -> bool:
    """Make this process the leader of a process group of its own, ended (SIGKILL) by a keeper as
    soon as this process ends, however it ends. For rank processes: what they start without a
    session of its own goes with them. False (and nothing done) where the process cannot move
    (a session leader)."""
    global _group_keeper
    if _group_keeper is not None:
        return True
    try:
        if os.getpgid(0) != os.getpid():
            os.setpgid(0, 0)
    except OSError as error:
        _say(f"process {os.getpid()} cannot lead a process group ({error}); its helpers may outlive it")
        return False
    run_id()
    _group_keeper = subprocess.Popen(
        [sys.executable, "-I", "-S", "-B", KEEPER, "--parent", str(os.getpid()), "--grace", "0"],
        stdin=subprocess.DEVNULL)
    return True


def children(pid: int | None = None) -> set[int]:
    """The live children of process `pid` (default: this one)."""
    parent = os.getpid() if pid is None else pid
    return {child for child, ppid in _parents().items() if ppid == parent}


def reap_with_this_process(roots: set[int]) -> subprocess.Popen | None:
    """A keeper that tracks the processes `roots` and their descendants (pidfds, refreshed every
    second) and SIGKILLs every one still alive when this process ends; it exits by itself once
    they have all ended. For what a library starts and watches too slowly: the processes of a
    local Ray instance (see `platform/ray_ranks.connect_ray`)."""
    if not roots:
        return None
    _reapers[:] = [r for r in _reapers if r.poll() is None]  # held, so that none is collected while running
    _reapers.append(subprocess.Popen(
        [sys.executable, "-I", "-S", "-B", KEEPER, "--parent", str(os.getpid()), "--grace", "0",
         "--tree", ",".join(map(str, sorted(roots)))], stdin=subprocess.DEVNULL, start_new_session=True))
    return _reapers[-1]


# ---- the keeper (this file as a script) -----------------------------------------------------------

def _reap_tree(parent: int, roots: list[int]) -> int:
    """Track `roots` and their descendants until `parent` ends (then SIGKILL them) or they all have."""
    for sig in _TERMINATING:
        signal.signal(sig, lambda *_: None)
    parent_fd = _pidfd(parent)
    tracked: dict[int, int] = {}
    for pid in roots:
        fd = _pidfd(pid)
        if fd is not None:
            tracked[pid] = fd
    while tracked:
        if os.getppid() != parent or (parent_fd is not None and parent_fd in _readable([parent_fd])):
            for fd in tracked.values():
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            return 137
        ended = set(_readable(list(tracked.values())))
        for pid, fd in list(tracked.items()):
            if fd in ended:
                os.close(fd)
                del tracked[pid]
        by_parent: dict[int, list[int]] = {}
        for pid, ppid in _parents().items():
            by_parent.setdefault(ppid, []).append(pid)
        frontier = list(tracked)
        while frontier:  # descendants not yet tracked (pidfds: a pid reused later is not ours)
            for child in by_parent.get(frontier.pop(), []):
                fd = None if child in tracked or child == os.getpid() else _pidfd(child)
                if fd is not None:
                    tracked[child] = fd
                    frontier.append(child)
        if parent_fd is not None:
            _wait_readable([parent_fd], 1.0)
        else:
            time.sleep(1.0)
    return 0



def _keep(parent: int, grace_s: float, cmd: list[str]) -> int:
    """Run `cmd` (if any) and exit as it does; when `parent` ends first, end this process group
    (SIGTERM, up to `grace_s` for the program, SIGKILL: this keeper included)."""
    group = os.getpgid(0)
    if group not in (os.getpid(), parent):  # never signal a group we were not made for
        _say(f"keeper {os.getpid()}: process group {group} is neither its own nor its parent's")
        return 2
    for sig in _TERMINATING:
        signal.signal(sig, lambda *_: None)  # a handler, not SIG_IGN: exec resets it for the program
    parent_fd = _pidfd(parent)
    child = None
    if cmd:
        try:
            child = subprocess.Popen(cmd, preexec_fn=_sigkill_when_parent_dies)  # one thread here: safe
        except OSError as error:
            _say(f"keeper: cannot start {cmd[0]}: {error}")
            return 127
    child_fd = _pidfd(child.pid) if child is not None else None
    exact = parent_fd is not None and (child is None or child_fd is not None)
    while True:
        if child is not None and child.poll() is not None:
            _kill_group_but_self(group)  # what the program left behind goes with it
            return _exit_like(child.returncode)
        if os.getppid() != parent:
            break
        fds = [fd for fd in (parent_fd, child_fd) if fd is not None]
        if _wait_readable(fds, None if exact else _POLL_S) and parent_fd in _readable(fds):
            break
    if grace_s > 0:
        _signal_group(group, signal.SIGTERM)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=grace_s)
    _signal_group(group, signal.SIGKILL)
    return 137


def _kill_group_but_self(group: int) -> None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                pgrp = int(f.read().rsplit(b")", 1)[1].split()[2])  # fields after the command name
        except (OSError, ValueError, IndexError):
            continue
        if pgrp == group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)


def _sigkill_when_parent_dies() -> None:
    import ctypes

    keeper = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != keeper:  # the keeper died before the line above took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _exit_like(returncode: int) -> int:
    """The keeper's exit status: the program's code, or death by the same signal."""
    if returncode >= 0:
        return returncode
    if -returncode not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
        signal.signal(-returncode, signal.SIG_DFL)
    os.kill(os.getpid(), -returncode)
    return 128 - returncode


# ---- helpers ---------------------------------------------------------------------------------------

def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process (zombies included)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    found[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # gone while we looked
                continue
    return found


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds here (or the process is already reaped): poll instead
        return None


def _wait_readable(fds: list[int], timeout_s: float | None) -> bool:
    """Whether one of `fds` became readable (a pidfd: its process ended) within `timeout_s`."""
    if not fds:
        time.sleep(timeout_s or _POLL_S)
        return False
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))


def _readable(fds: list[int]) -> list[int]:
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(0)]


def _say(message: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"sao: {message}\n".encode())


def _main(argv: list[str]) -> int:
    """`python -I -S lifetime.py --parent PID [--grace S] [--tree PID,PID] [-- CMD ...]`."""
    cmd: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, cmd = argv[:cut], argv[cut + 1:]
    options = dict(zip(argv[::2], argv[1::2], strict=False))
    if len(argv) % 2 or "--parent" not in options:
        _say("usage: lifetime.py --parent PID [--grace SECONDS] [--tree PID,PID] [-- CMD ...]")
        return 2
    if "--tree" in options:
        return _reap_tree(int(options["--parent"]), [int(p) for p in options["--tree"].split(",") if p])
    return _keep(int(options["--parent"]), float(options.get("--grace", DEFAULT_GRACE_S)), cmd)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
