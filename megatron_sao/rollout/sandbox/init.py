"""Privileged half of the Python tool sandbox: run as a script, never imported by model code.

`run.py` starts this file (by path) with the trainer's own interpreter (`python -I -S -B`, stdlib only,
so nothing from the project or the user's environment is imported while we still hold root)
and writes one JSON spec to its stdin. Three processes follow:

    S  supervisor   unshares the network / mount / PID namespaces, enforces the wall clock
                    (SIGALRM), answers SIGTERM from the parent (and, through PDEATHSIG, the
                    parent's death), sweeps leftovers when there is
                    no PID namespace, reports JSON status lines on stderr.
    I  init         first process of the new PID namespace (PID 1): mounts a fresh /proc, masks
                    home directories, makes every mount read-only, mounts the private tmpfs
                    scratch on /tmp, writes the program, forks U and reaps. When I exits the
                    kernel kills everything left in the namespace, daemons included.
    U  user code    rlimits, unprivileged uid/gid, no_new_privs, scrubbed environment, stdin
                    from /dev/null, stdout+stderr into the pipe the parent reads; then exec.

Every status line is a small JSON object (atomic pipe write) on S's stderr; the parent merges
them. Why a separate script rather than `preexec_fn`: `preexec_fn` is unsafe in the threaded
agent loop, and the PID namespace needs an intermediate process anyway. It is one
self-contained file because it runs with `-I -S`, before anything of the project is importable.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import resource
import select
import signal
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
_MOUNT_OPTION_FLAGS = {
    "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME,
}
_NAMESPACE_FLAGS = {"net": os.CLONE_NEWNET, "mount": os.CLONE_NEWNS, "pid": os.CLONE_NEWPID}
_PROGRAM_NAME = "main.py"

_libc = ctypes.CDLL(None, use_errno=True)


class _Stop(Exception):
    """Raised from the SIGALRM / SIGTERM handlers to break out of a blocking wait."""


def _report(**fields: object) -> None:
    os.write(2, (json.dumps(fields) + "\n").encode())


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(value: str | None) -> bytes | None:
        return None if value is None else value.encode()

    if _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount({source!r}, {target!r}, {fstype!r}): {os.strerror(err)}")


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _unescape_mountinfo(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as 3-digit octal (`\\040`)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit() and len(field[i + 1:i + 4]) == 3:
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _remount_everything_readonly() -> None:
    """Bind-remount every visible mount read-only, keeping its nosuid/nodev/noexec/atime flags.

    A per-mount loop rather than `mount_setattr(AT_RECURSIVE)` so that it works on any kernel
    that has mount namespaces. Mounts shadowed by a later mount on the same path, or hidden
    under a masked directory (systemd hosts mount things under /run), are unreachable by path:
    leaving them writable gives the sandbox nothing, so a path that no longer resolves is skipped.
    """
    with open("/proc/self/mountinfo") as f:
        entries = [line.split() for line in f]
    seen: set[str] = set()
    for fields in entries:
        target = _unescape_mountinfo(fields[4])
        if target in seen:
            continue
        seen.add(target)
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= _MOUNT_OPTION_FLAGS.get(option, 0)
        try:
            _mount(None, target, None, flags)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise


def _expose_under(top: str, exposed: list[tuple[str, int]]) -> list[str]:
    """Bind-mount back each opened path that lies under `top` (just covered by a new mount)."""
    mounted = []
    for path, fd in exposed:
        if path == top or path.startswith(top.rstrip("/") + "/"):
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            mounted.append(path)
    return mounted


def _setup_mounts(spec: dict, uid: int | None, new_pid_ns: bool) -> str:
    """Build the sandbox's view of the filesystem; returns the scratch directory (cwd)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do may propagate to the host
    if new_pid_ns:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # Interpreter installs that live under a masked directory (pyenv under /root) or under /tmp
    # (a checkout and its venv in /tmp) are opened before the mask / scratch hides them, then
    # bind-mounted back, read-only, at the same path through /proc.
    exposed: list[tuple[str, int]] = []
    for path in spec["exposed_paths"]:
        if os.path.isdir(path):
            exposed.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
    try:
        for masked in spec["masked_paths"]:
            if not os.path.isdir(masked) or os.path.islink(masked):
                continue
            _mount("tmpfs", masked, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
            _expose_under(masked, exposed)
        _remount_everything_readonly()
        owner = f",uid={uid},gid={uid}" if uid is not None else ""
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['scratch_mb']}m,mode=700{owner}")
        for path in _expose_under("/tmp", exposed):
            _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    finally:
        for _, fd in exposed:
            os.close(fd)
    return "/tmp"


def _exec_user(spec: dict, uid: int | None, scratch: str) -> None:
    """Become the model's program: limits, identity, fds, environment, then exec (never returns)."""
    try:
        mem = spec["memory_mb"] * 1024 * 1024
        cpu = max(1, math.ceil(spec["cpu_time_s"]))
        fsize = spec["scratch_mb"] * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NOFILE, (spec["max_open_files"], spec["max_open_files"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if uid is not None:  # per-uid count: only meaningful because the uid is ours alone
            resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_processes"], spec["max_processes"]))
        os.chdir(scratch)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(1, 2)
        os.closerange(3, 65536)
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        env = dict(spec["env"], HOME=scratch, TMPDIR=scratch)
        python = spec["python"]
        os.execve(python, [python, *spec["python_args"], _PROGRAM_NAME], env)
    except OSError as e:
        os.write(2, f"sandbox: could not start the program ({e}); the interpreter "
                    f"{spec['python']!r} must be executable by an unprivileged user\n".encode())
    os._exit(127)


def _init_main(spec: dict, isolation: list[str], uid: int | None, lifeline: int) -> None:
    """Process I. Never returns."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the supervisor died -> so does the sandbox
        if select.select([lifeline], [], [], 0)[0]:  # it died before the line above took effect
            os._exit(0)
        os.close(lifeline)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if "pid" not in isolation:
            os.setpgid(0, 0)  # one group the supervisor can kill after we exit
        scratch = spec["host_scratch"]
        if "mount" in isolation:
            try:
                scratch = _setup_mounts(spec, uid, new_pid_ns="pid" in isolation)
            except OSError as e:
                _report(missing={"mount": f"filesystem setup failed: {e}"})
                if spec["strict"]:
                    _report(setup_error=f"mount setup failed: {e}")
                    os._exit(0)
        path = os.path.join(scratch, _PROGRAM_NAME)
        with open(path, "w", encoding="utf-8", errors="replace") as f:  # lone surrogates: replaced
            f.write(spec["code"])
        os.chmod(path, 0o644)
        child = os.fork()
        if child == 0:
            _exec_user(spec, uid, scratch)
        # Backstop if the supervisor cannot stop us (it normally does, at exactly timeout_s).
        signal.signal(signal.SIGALRM, lambda *_: os.kill(child, signal.SIGKILL))
        signal.alarm(math.ceil(spec["timeout_s"]) + 2)
        while True:  # as PID 1 we also reap orphans re-parented to us
            pid, status = os.wait()
            if pid == child:
                break
        if os.WIFSIGNALED(status):
            _report(signal=os.WTERMSIG(status))
        else:
            _report(exit_code=os.waitstatus_to_exitcode(status))
    except BaseException as e:  # anything here is a setup failure, reported as such
        _report(setup_error=f"sandbox init failed: {type(e).__name__}: {e}")
    os._exit(0)


def _reap_nowait() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _uid_has_processes(uid: int) -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if str(uid) in line.split()[1:]:
                            return True
                        break
        except OSError:  # exited while we looked
            continue
    return False


def _sweep_uid(uid: int) -> None:
    """Without a PID namespace: SIGKILL every process of the sandbox's private uid.

    A helper that takes the uid and calls kill(-1) reaches exactly those processes, including
    ones that escaped with setsid(). Repeated until /proc shows none (kill(-1) itself cannot
    tell us: it succeeds whenever any process exists). Killed orphans come back to us as
    zombies, which still count, so we reap between rounds.
    """
    for _ in range(200):
        _reap_nowait()
        if not _uid_has_processes(uid):
            return
        helper = os.fork()
        if helper == 0:
            try:
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(helper, 0)
        time.sleep(0.002)


def _wait_for_init(init: int, timeout_s: float) -> str | None:
    """Wait for I; on the wall-clock deadline or the parent's SIGTERM, kill it. Returns why."""
    reason: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        reason.append("timeout" if signum == signal.SIGALRM else "stopped")
        raise _Stop

    signal.signal(signal.SIGALRM, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    reaped = False
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        os.waitpid(init, 0)
        reaped = True
    except _Stop:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if not reaped:
        try:
            os.kill(init, signal.SIGKILL)  # I is PID 1: its death takes the namespace with it
            os.waitpid(init, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return reason[0] if reason else None


def _reap_leftovers(init: int, uid: int | None) -> None:
    """Without a PID namespace: kill I's process group and the sandbox uid, then reap."""
    with contextlib.suppress(OSError):
        os.killpg(init, signal.SIGKILL)
    if uid is not None:
        _sweep_uid(uid)
    deadline = time.monotonic() + 1.0  # we are the subreaper; a non-root escapee must not hang us
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def main() -> None:
    # The caller ending (killed, or its run torn down) is a stop request, answered below as the
    # caller's SIGTERM is. PDEATHSIG follows the thread that started us: it waits for us in
    # run_python, so here it is exact.
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if len(sys.argv) > 1 and os.getppid() != int(sys.argv[1]):
        return  # the caller died before the line above took effect
    spec = json.loads(sys.stdin.buffer.read())
    os.umask(0o022)
    missing: dict[str, str] = {}
    isolation: list[str] = []
    for name in spec["namespaces"]:
        try:
            os.unshare(_NAMESPACE_FLAGS[name])
            isolation.append(name)
        except OSError as e:
            missing[name] = f"unshare({name}) failed: {e}"
    uid = None
    if spec["drop_privileges"]:
        if os.geteuid() == 0:
            uid = spec["uid_base"] + os.getpid()  # unique while we live: our pid is
            os.chown(spec["host_scratch"], uid, uid)
            isolation.append("user")
        else:
            missing["user"] = "not running as root, so the code keeps the caller's uid"
    _report(isolation=isolation, missing=missing, uid=uid)
    if spec["strict"] and missing:
        _report(setup_error="isolation unavailable (strict mode): " + "; ".join(missing.values()))
        return
    if "pid" not in isolation:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans come back to us to be reaped
    lifeline_r, lifeline_w = os.pipe()  # I sees EOF here if we died before its PDEATHSIG was set
    init = os.fork()
    if init == 0:
        os.close(lifeline_w)
        _init_main(spec, isolation, uid, lifeline_r)
    os.close(lifeline_r)
    reason = _wait_for_init(init, spec["timeout_s"])
    if "pid" not in isolation:
        _reap_leftovers(init, uid)
    _report(done=True, timed_out=reason == "timeout", stopped=reason == "stopped")


if __name__ == "__main__":
    main()
