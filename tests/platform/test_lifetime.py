"""No process a run starts outlives it (utils/lifetime.py): each starter, each way a run ends.

Every scenario runs in a driver process of its own tagged with a fresh SAO_RUN_ID
(`tests/platform/lifetime_jobs.py`); after the run ends, no live process may carry that id. The
end-to-end runs (`sao train` with the CPU engine, locally and on Ray) are in
tests/pipeline/test_engine_lifetime.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from megatron_sao.utils import lifetime
from tests.platform.lifetime_jobs import alive, new_run_env, tagged, wait_for_file, wait_for_none

SECONDS = 10.0
"""Within how long after the run ends everything it started must be gone (measured: under 1 s
for the pidfd watches; up to DEFAULT_GRACE_S for a program that ignores SIGTERM)."""


def _driver(mode: str, tmp_path, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.platform.lifetime_jobs", mode, str(tmp_path)], env=env,
                            cwd=tmp_path)


def _kill_and_check(proc: subprocess.Popen, run: str, also: set[int] = frozenset()) -> float:
    proc.kill()
    proc.wait()
    waited, left = wait_for_none(run, SECONDS, also)
    assert not left, f"still alive {waited:.1f} s after the driver was killed: {left}"
    return waited


# ---- start_child: the keeper and die_with_parent --------------------------------------------------

def test_keeper_exits_as_its_program_does():
    assert lifetime.start_child([sys.executable, "-c", "raise SystemExit(3)"]).wait() == 3
    killed = lifetime.start_child([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert killed.wait() == -signal.SIGKILL


def test_keeper_ends_what_its_program_left():
    program = "import subprocess; print(subprocess.Popen(['sleep', '600']).pid)"
    process = lifetime.start_child([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    left = int(process.stdout.readline())
    assert process.wait() == 0
    deadline = time.monotonic() + 5
    while alive({left}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive({left})


STARTER = """
import sys, threading, time
from megatron_sao.utils.lifetime import start_child
OWN = "from megatron_sao.utils.lifetime import die_with_parent; die_with_parent(); import time; time.sleep(600)"
FOREIGN = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"
def start():  # from a thread that exits at once: PR_SET_PDEATHSIG would fire here, a pidfd does not
    own = sys.argv[1] == "own"
    child = start_child([sys.executable, "-c", OWN if own else FOREIGN], watches_parent=own)
    print(child.pid, flush=True)
thread = threading.Thread(target=start)
thread.start()
thread.join()
time.sleep(600)
"""


@pytest.mark.parametrize("kind", ["own", "foreign"])
def test_child_outlives_its_starting_thread_and_ends_with_its_starter(tmp_path, kind):
    """Our program (die_with_parent) and a foreign one with a child of its own (the keeper): both
    survive the thread that started them, both end within seconds of their starter's SIGKILL."""
    run, env = new_run_env()
    proc = subprocess.Popen([sys.executable, "-c", STARTER, kind], env=env, stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    time.sleep(1.0)  # the starting thread has long exited
    expected = 2 if kind == "own" else 4  # starter, program (+ keeper, + the program's child)
    assert alive({child}) and len(tagged(run)) == expected, tagged(run)
    _kill_and_check(proc, run)


def test_die_with_parent_exits_when_the_parent_is_already_gone():
    """SAO_PARENT_PID naming a process that is not our parent (it died before we started)."""
    code = "from megatron_sao.utils.lifetime import die_with_parent; die_with_parent(); print('survived')"
    env = {**os.environ, lifetime.PARENT_PID_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL and "survived" not in out.stdout, out


def test_stop_groups_ends_the_whole_tree():
    program = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"
    process = lifetime.start_child([sys.executable, "-c", program])
    deadline = time.monotonic() + 60
    while len(psutil.Process(process.pid).children(recursive=True)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    tree = {p.pid for p in psutil.Process(process.pid).children(recursive=True)} | {process.pid}
    lifetime.stop_groups([process], timeout_s=5)
    assert process.returncode == -signal.SIGTERM  # the program's own exit, mirrored by its keeper
    assert not alive(tree)


# ---- ranks (platform/spawn.py run_distributed) --------------------------------------------------

# Slow: the killed-driver and killed-rank cases stay in the default suite.
@pytest.mark.slow
def test_rank_exiting_leaves_nothing(tmp_path):
    """Rank 0 exits (as one killed inside a checkpoint save does) while rank 1 waits: RankFailed,
    and neither rank nor the Manager server each one started (Megatron's torch_dist writer does)
    survives. Before: the exited rank's Manager stayed, re-parented to init."""
    run, env = new_run_env()
    proc = _driver("ranks-exit", tmp_path, env)
    assert proc.wait(timeout=300) == 0 and (tmp_path / "rank_failed").exists()
    waited, left = wait_for_none(run, SECONDS)
    assert not left, f"still alive {waited:.1f} s after run_distributed raised: {left}"


def test_ranks_end_with_a_killed_driver(tmp_path):
    run, env = new_run_env()
    proc = _driver("ranks-sleep", tmp_path, env)
    for rank in range(2):
        wait_for_file(tmp_path / f"rank{rank}", 300, proc)
    _kill_and_check(proc, run)


def test_killed_rank_takes_its_helpers_along(tmp_path):
    """SIGKILL of one rank (its driver alive): its process group (the Manager) goes at once; the
    driver then fails the launch and ends the other rank."""
    run, env = new_run_env()
    proc = _driver("ranks-sleep", tmp_path, env)
    for rank in range(2):
        wait_for_file(tmp_path / f"rank{rank}", 300, proc)
    ranks = [p for p in psutil.Process(proc.pid).children() if "multiprocessing.spawn" in " ".join(p.cmdline())
             and "resource_tracker" not in " ".join(p.cmdline())]
    assert len(ranks) == 2
    helpers = {p.pid for p in ranks[0].children(recursive=True)}
    ranks[0].kill()
    waited, left = wait_for_none(run, SECONDS)
    assert not left, f"still alive {waited:.1f} s after rank 0 was killed: {left}"
    assert proc.wait(timeout=5) == 0 and (tmp_path / "rank_failed").exists()
    assert helpers and not alive(helpers)


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


# ---- the sandbox and a local Ray instance ------------------------------------------------------

def test_sandbox_ends_with_its_caller(tmp_path):
    """run_python in a thread of a process that is SIGKILLed: the supervisor (tagged), the
    namespace init and the model's program (scrubbed environment: found as descendants) all go."""
    run, env = new_run_env()
    proc = _driver("sandbox", tmp_path, env)
    deadline = time.monotonic() + 120
    tree: set[int] = set()
    while time.monotonic() < deadline:
        children = psutil.Process(proc.pid).children(recursive=True)
        tree = {p.pid for p in children}
        if any(_cmdline(p).endswith("main.py") for p in children):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the sandboxed program never started")
    _kill_and_check(proc, run, also=tree)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_ray_ends_with_a_killed_driver(tmp_path):
    """What Ray itself does (GCS and raylet get PR_SET_PDEATHSIG from `ray.init()`, workers exit
    when the raylet is gone), plus ours in its workers: a lead_process_group Manager and a child
    under a keeper. Every process of the Ray instance carries the run id."""
    run, env = new_run_env()
    proc = _driver("ray", tmp_path, env)
    wait_for_file(tmp_path / "ray_ready", 300, proc)
    names = " ".join(tagged(run).values())
    assert "raylet" in names and "gcs_server" in names and "sleep 600" in names, names
    _kill_and_check(proc, run)


def test_thread_that_starts_a_child_need_not_live():
    """A child started from a short-lived thread of this process keeps running (no PDEATHSIG)."""
    box: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: box.append(lifetime.start_child(["sleep", "600"])))
    thread.start()
    thread.join()
    time.sleep(0.5)
    try:
        assert box[0].poll() is None
    finally:
        lifetime.stop_groups(box, timeout_s=5)
