"""A real two-node Slurm cluster on this machine for the launcher tests (launchers/local-slurm/).

Started once per test session by the first test that asks for `local_slurm` (installing the
Debian packages with apt-get the first time: CI runs as root on a fresh machine), stopped at the
end. A cluster that is already up with at least two nodes is left running afterwards; as root the
start script still runs (it is idempotent) so that its configuration holds, e.g. the 15 s
credential lifetime after which a requeued job starts again (Slurm's default: 120 s). The tests
skip, with the start script's own last lines as the reason, only where Slurm cannot start (not
root, no apt-get and no Slurm, or the install failing).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

LOCAL_SLURM = Path(__file__).resolve().parents[2] / "launchers" / "local-slurm"
NODES = 2


def _cluster_up(min_nodes: int) -> bool:
    if not shutil.which("scontrol") or not shutil.which("sinfo"):
        return False
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    if "is UP" not in ping.stdout:
        return False
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True).stdout.split("\n")
    usable = {line.split()[0] for line in nodes if line.strip() and line.split()[1] in ("idle", "mix", "alloc")}
    return len(usable) >= min_nodes


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[int]:
    """The number of nodes of a running local Slurm cluster (>= 2)."""
    was_up = _cluster_up(NODES)
    if os.geteuid() != 0:
        if was_up:  # someone else's cluster: used as it is
            yield NODES
            return
        pytest.skip("local Slurm needs root to install and start its daemons (CI runs as root)")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.skip("no Slurm installed and no apt-get to install it")
    env = {**os.environ, "SLURM_LOCAL_NODES": str(NODES), "DEBIAN_FRONTEND": "noninteractive"}
    start = subprocess.run(["bash", str(LOCAL_SLURM / "start_local_slurm.sh")], env=env, capture_output=True,
                           text=True, timeout=900)
    if start.returncode != 0 or not _cluster_up(NODES):
        tail = "\n".join((start.stderr or start.stdout).strip().splitlines()[-8:])
        pytest.skip(f"local Slurm could not start (launchers/local-slurm/start_local_slurm.sh exit "
                    f"{start.returncode}):\n{tail}")
    if was_up:
        yield NODES
        return
    try:
        yield NODES
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM / "stop_local_slurm.sh")], capture_output=True, timeout=300)
