"""The Python tool sandbox: limits, isolation, and that every failure is a result, not a crash.

These tests run as root on a machine that has the namespaces, so they exercise the real
isolation: each asserts the primitives were in force rather than skipping when they are not.
Where a check could pass vacuously (a refused socket, a refused write) a control run without
the relevant primitive shows the same code succeeding.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_sao.rollout.sandbox import SandboxConfig, run_python
from megatron_sao.rollout.sandbox.config import MAX_PID

FULL = ("net", "mount", "pid", "user")
UID_BASE = 2_010_000_000  # private to this file, so concurrent sandbox users do not disturb counts


def uid_processes(uid_base: int) -> list[int]:
    """Live (or zombie) processes whose real uid belongs to sandboxes made with `uid_base`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if uid_base <= uid < uid_base + MAX_PID:  # sandbox uids are uid_base + supervisor pid
            found.append(int(entry))
    return found


def _cfg(**kwargs: object) -> SandboxConfig:
    return SandboxConfig(uid_base=UID_BASE, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A directory every user can reach, outside /tmp (the sandbox mounts its scratch there)."""
    path = Path(tempfile.mkdtemp(prefix="sao-sandbox-test-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_runs_code_with_full_isolation() -> None:
    r = run_python("import os\nprint('hello', os.getuid() != 0, os.getcwd())", config=_cfg())
    assert r.ok, r
    assert r.output == "hello True /tmp\n"
    assert set(r.isolation) == set(FULL)
    assert r.exit_code == 0 and r.error is None and not r.timed_out


def test_infinite_loop_killed_within_timeout_plus_2s() -> None:
    start = time.monotonic()
    r = run_python("while True:\n    pass\n", timeout_s=2.0, config=_cfg())
    elapsed = time.monotonic() - start
    assert r.timed_out and not r.ok
    assert r.error == "timed out after 2 s"
    assert elapsed < 2.0 + 2.0, elapsed


def test_sleeping_code_hits_the_wall_clock_not_the_cpu_limit() -> None:
    r = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)\n", timeout_s=1.5, config=_cfg())
    assert r.timed_out
    assert r.output == "start\n"  # output produced before the kill is kept


def test_cpu_time_limit() -> None:
    r = run_python("while True:\n    pass\n", timeout_s=20.0, config=_cfg(cpu_time_s=1))
    assert not r.timed_out
    assert r.error == "CPU time limit exceeded"
    assert r.duration_s < 10.0


def test_4gb_allocation_refused() -> None:
    r = run_python("x = bytearray(4 * 1024**3)\nprint('allocated')\n", memory_mb=1024, config=_cfg())
    assert not r.ok
    assert r.error == "memory limit exceeded (1024 MB)"
    assert "MemoryError" in r.output and "allocated" not in r.output


def test_memory_within_limit_is_fine() -> None:
    r = run_python("x = bytearray(200 * 1024**2)\nprint(len(x) // 2**20)\n", memory_mb=1024, config=_cfg())
    assert r.ok and r.output == "200\n"


FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""

FORK_COUNT = """
import os, time
n = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    n += 1
print(n)
"""


def test_fork_bomb_contained() -> None:
    start = time.monotonic()
    r = run_python(FORK_BOMB, timeout_s=3.0, config=_cfg(max_processes=16))
    assert r.timed_out and time.monotonic() - start < 3.0 + 2.0
    assert uid_processes(UID_BASE) == []
    counted = run_python(FORK_COUNT, timeout_s=10.0, config=_cfg(max_processes=16))
    assert counted.ok, counted
    assert 0 < int(counted.output) < 16  # the program itself is one of the 16 tasks
    assert uid_processes(UID_BASE) == []


@pytest.fixture
def listening_port() -> Iterator[tuple[int, list]]:
    """A real TCP server on the host's 127.0.0.1 that records every connection it accepts."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[object] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            accepted.append(conn)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


CONNECT = "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')\n"


def test_socket_to_localhost_refused(listening_port: tuple[int, list]) -> None:
    port, accepted = listening_port
    r = run_python(CONNECT.format(port=port), config=_cfg())
    assert not r.ok and "connected" not in r.output
    assert "Network is unreachable" in r.output
    assert accepted == []
    control = run_python(CONNECT.format(port=port), config=_cfg(namespaces=("mount", "pid")))
    assert control.ok and control.output == "connected\n"  # the check can fail
    assert len(accepted) == 1


WRITE_ATTEMPTS = """
import os
targets = {targets!r}
for path in targets:
    try:
        with open(path, "a") as f:
            f.write("pwned")
        print("WROTE", path)
    except OSError as e:
        print("refused", path, type(e).__name__)
with open("in_scratch.txt", "w") as f:
    f.write("fine")
with open("/tmp/also_scratch.txt", "w") as f:
    f.write("fine")
print("scratch ok", sorted(os.listdir(".")))
"""


def test_writing_outside_scratch_refused(world_dir: Path) -> None:
    # A world-writable directory and file: the uid alone would not stop these writes.
    open_dir = world_dir / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    victim = open_dir / "victim.txt"
    victim.write_text("original")
    victim.chmod(0o666)
    targets = [str(open_dir / "new.txt"), str(victim), "/etc/sao_sandbox_test", "/var/tmp/sao_sandbox_test",
               "/dev/shm/sao_sandbox_test", "/root/sao_sandbox_test", str(Path.cwd() / "sao_sandbox_test")]
    r = run_python(WRITE_ATTEMPTS.format(targets=targets), config=_cfg())
    assert r.ok, r
    assert "WROTE" not in r.output
    assert r.output.count("refused") == len(targets)
    # An interpreter installed under /tmp (a checkout in /tmp) is bind-mounted back, read-only.
    exposed = {Path(p).parts[2] for p in {sys.prefix, sys.base_prefix} if Path(p).parts[1:2] == ("tmp",)}
    assert f"scratch ok {sorted({'also_scratch.txt', 'in_scratch.txt', 'main.py'} | exposed)}" in r.output
    assert victim.read_text() == "original" and not (open_dir / "new.txt").exists()
    for path in targets[2:]:
        assert not Path(path).exists(), path
    # Control: without the mount namespace the same code can write the world-writable file.
    control = run_python(WRITE_ATTEMPTS.format(targets=[str(victim)]),
                         config=_cfg(namespaces=("net", "pid"), python="/usr/bin/python3"))
    assert "WROTE" in control.output and victim.read_text() == "originalpwned"


def test_masked_paths_are_hidden(world_dir: Path) -> None:
    secret_dir = world_dir / "home"
    secret_dir.mkdir()
    (secret_dir / "token.txt").write_text("secret")
    (secret_dir / "token.txt").chmod(0o644)
    code = f"import os\nprint(os.listdir({str(secret_dir)!r}))\n"
    assert run_python(code, config=_cfg(namespaces=("net", "pid"), python="/usr/bin/python3")).output == \
        "['token.txt']\n"  # visible without the mask
    r = run_python(code, config=_cfg(masked_paths=(*SandboxConfig().masked_paths, str(secret_dir))))
    assert r.ok and r.output == "[]\n"


def test_identity_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAO_TEST_SECRET_TOKEN", "hunter2")
    code = """
import os
print(os.getuid() >= 2_010_000_000, os.getgid() == os.getuid(), os.getgroups())
print("SAO_TEST_SECRET_TOKEN" in os.environ, os.environ["HOME"], os.environ["TMPDIR"])
print([l.split()[1] for l in open("/proc/self/status") if l.startswith("NoNewPrivs")])
try:
    os.setuid(0)
    print("became root")
except PermissionError:
    print("cannot become root")
print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit())[:2])
"""
    r = run_python(code, config=_cfg())
    assert r.ok, r
    assert r.output.splitlines() == [
        "True True []", "False /tmp /tmp", "['1']", "cannot become root", "[1, 2]",  # PID 1 is init
    ]


def test_output_truncated_and_program_stopped() -> None:
    cfg = _cfg(max_output_bytes=1000)
    start = time.monotonic()
    r = run_python("while True:\n    print('spam' * 50)\n", timeout_s=20.0, config=cfg)
    assert time.monotonic() - start < 5.0
    assert not r.ok and r.output_truncated and not r.timed_out
    assert r.error == "output limit exceeded (1000 bytes); the program was stopped"
    assert r.output.startswith("spam") and r.output.endswith("[output truncated at 1000 bytes]")
    assert len(r.output) < 1100


def test_crashes_and_exceptions_are_results() -> None:
    abort = run_python("import os\nos.abort()\n", config=_cfg())
    assert not abort.ok and abort.error == "killed by signal SIGABRT" and abort.signal == 6
    raised = run_python("print('before')\n1 / 0\n", config=_cfg())
    assert not raised.ok and raised.exit_code == 1 and raised.error == "exited with status 1"
    assert raised.output.startswith("before\n") and "ZeroDivisionError" in raised.output
    assert 'File "/tmp/main.py", line 2' in raised.output  # the model sees its own line
    syntax = run_python("def f(:\n", config=_cfg())
    assert not syntax.ok and "SyntaxError" in syntax.output


def test_scratch_is_size_limited() -> None:
    code = "with open('big', 'wb') as f:\n    f.write(b'x' * (32 * 2**20))\n"
    r = run_python(code, config=_cfg(scratch_mb=8))
    assert not r.ok and ("File too large" in r.output or "No space left" in r.output)


def test_too_large_code_and_bad_arguments() -> None:
    r = run_python("x = 1\n" * 200, config=_cfg(max_code_bytes=100))
    assert not r.ok and r.error == "code is 1200 bytes, over the 100-byte limit"
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="namespaces"):
        SandboxConfig(namespaces=("ipc",))
    with pytest.raises(ValueError, match="uid_base"):
        SandboxConfig(uid_base=0)
    missing_root = run_python("pass", config=_cfg(scratch_root="/nonexistent/sao"))
    assert not missing_root.ok and missing_root.error.startswith("sandbox setup failed: cannot create a scratch")


def test_undecodable_text_in_code_is_replaced_not_fatal() -> None:
    r = run_python('print("a\udc80b")', config=_cfg())  # a lone surrogate, as a bad decode can leave
    assert r.ok and r.output == "a?b\n"


DAEMON = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(120)
    os._exit(0)
print("spawned")
"""


@pytest.mark.parametrize("namespaces", [("net", "mount", "pid"), ("net", "mount")],
                         ids=["pid-namespace", "uid-sweep"])
def test_escaped_daemon_is_killed_at_the_end(namespaces: tuple[str, ...]) -> None:
    r = run_python(DAEMON, config=_cfg(namespaces=namespaces))
    assert r.ok and r.output == "spawned\n"
    assert uid_processes(UID_BASE) == []


def test_unescape_mountinfo() -> None:
    from megatron_sao.rollout.sandbox.init import _unescape_mountinfo

    assert _unescape_mountinfo("/mnt/a\\040b\\134c") == "/mnt/a b\\c"
    assert _unescape_mountinfo("/plain") == "/plain"
    assert _unescape_mountinfo("/end\\04") == "/end\\04"
