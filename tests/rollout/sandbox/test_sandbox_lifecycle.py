"""Sandbox lifecycle under load: no leaked processes, directories or fds; concurrency; degradation."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from megatron_sao.rollout.sandbox import SandboxConfig, SandboxPool, run_python_async
from tests.rollout.sandbox.test_sandbox import uid_processes

UID_BASE = 2_020_000_000

HANGS = [
    "while True:\n    pass\n",
    "import time\ntime.sleep(600)\n",
    # a hanging child that leaves the process group, and a grandchild daemon
    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    os.fork()\n    time.sleep(600)\n"
    "time.sleep(600)\n",
]


def _workload(num_calls: int, hang_every: int) -> list[str]:
    return [HANGS[(i // hang_every) % len(HANGS)] if i % hang_every == hang_every - 1
            else f"import os\nprint({i} * 2, os.getpid())\n" for i in range(num_calls)]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _run_all(pool: SandboxPool, codes: list[str], timeout_s: float, hang_timeout_s: float | None = None) -> list:
    """Hanging programs get `hang_timeout_s` (short, to keep the test fast); the others get a
    generous `timeout_s`, so that a loaded machine cannot turn them into timeouts."""
    return await asyncio.gather(*(pool.run(code, timeout_s=hang_timeout_s if code in HANGS and hang_timeout_s
                                           else timeout_s) for code in codes))


def _check_no_leaks(num_calls: int, hang_every: int, concurrency: int, scratch_root: Path) -> float:
    """Run the workload through a pool; assert every result and that nothing is left behind."""
    fds_before = _open_fds()
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    codes = _workload(num_calls, hang_every)
    config = SandboxConfig(uid_base=UID_BASE, scratch_root=str(scratch_root))
    start = time.monotonic()
    with SandboxPool(config, max_concurrency=concurrency) as pool:
        results = asyncio.run(_run_all(pool, codes, timeout_s=20.0, hang_timeout_s=1.0))
    elapsed = time.monotonic() - start
    for i, (code, result) in enumerate(zip(codes, results, strict=True)):
        if code in HANGS:
            assert result.timed_out and not result.ok, (i, result)
        else:
            assert result.ok and result.output.startswith(f"{i * 2} "), (i, result)
    assert uid_processes(UID_BASE) == []
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before] == []
    assert list(scratch_root.iterdir()) == []
    assert _open_fds() == fds_before
    return elapsed


def test_no_leaked_processes_200_calls_10pct_hanging(tmp_path: Path) -> None:
    """~10 s on 2 busy cores, so it stays in the default suite."""
    elapsed = _check_no_leaks(num_calls=200, hang_every=10, concurrency=8, scratch_root=tmp_path)
    print(f"200 sandbox calls (20 hanging, timeout 1 s, concurrency 8): {elapsed:.1f} s")


def test_async_calls_run_concurrently() -> None:
    code = "import time\ntime.sleep(1.0)\nprint('done')\n"
    with SandboxPool(SandboxConfig(uid_base=UID_BASE), max_concurrency=6) as pool:
        start = time.monotonic()
        results = asyncio.run(_run_all(pool, [code] * 6, timeout_s=10.0))
        elapsed = time.monotonic() - start
    assert all(r.ok and r.output == "done\n" for r in results)
    assert elapsed < 4.0, elapsed  # serially it would be > 6 s


def test_run_python_async_default_pool() -> None:
    result = asyncio.run(run_python_async("print(6 * 7)"))
    assert result.ok and result.output == "42\n"


DEGRADED_SCRIPT = """
import json, logging, sys
logging.basicConfig(stream=sys.stderr)
from megatron_sao.rollout.sandbox import SandboxConfig, run_python
out = {}
for name, cfg in [("auto", SandboxConfig(python="/usr/bin/python3")),
                  ("strict", SandboxConfig(python="/usr/bin/python3", strict=True))]:
    r = run_python("print('ran')", timeout_s=5, config=cfg)
    out[name] = [r.ok, r.output, r.error, list(r.isolation)]
print(json.dumps(out))
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv")
def test_degrades_with_warnings_or_refuses_in_strict_mode() -> None:
    """Root without CAP_SYS_ADMIN (a typical container): no namespaces can be made."""
    proc = subprocess.run(
        ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", "--", sys.executable, "-c",
         DEGRADED_SCRIPT], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[3],
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["auto"] == [True, "ran\n", None, ["user"]]
    ok, _, error, _ = out["strict"]
    assert not ok and error.startswith("sandbox setup failed: isolation unavailable (strict mode)")
    for name in ("net", "mount", "pid"):
        assert f"sandbox: {name} isolation unavailable" in proc.stderr
    assert "model code CAN reach the network" in proc.stderr


MOUNT_UNDER_MASK = """
import subprocess, sys
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", sys.argv[1] + "/inner"], check=True)
from megatron_sao.rollout.sandbox import SandboxConfig, run_python
r = run_python("import os\\nprint(os.listdir(%r))" % sys.argv[1],
               config=SandboxConfig(masked_paths=("/root", sys.argv[1])))
print(r.ok, r.output.strip(), sorted(r.isolation), r.error)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_host_mounts_under_a_masked_directory() -> None:
    """Hosts mount things under masked paths (systemd: /run/user/..., /run/credentials/...). The
    check runs in a private mount namespace of its own, so the host's mount table is untouched."""
    masked = Path(tempfile.mkdtemp(prefix="sao-mask-", dir="/var/tmp"))
    try:
        (masked / "inner").mkdir()
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c",
                               MOUNT_UNDER_MASK, str(masked)], capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).parents[3])
    finally:
        shutil.rmtree(masked, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True [] ['mount', 'net', 'pid', 'user'] None"
