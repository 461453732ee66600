"""platform/launch.py: which launcher a config's ranks get, and the local path end to end with a
stop signal passed on to every rank (what `sao train` and `sao value-pretrain train` both do)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from megatron_sao.config import load_config
from megatron_sao.platform import launch
from megatron_sao.platform.launch import launch_ranks, rank_launcher


def _launcher(*overrides: str):
    return load_config(None, list(overrides)).launcher


def test_the_launcher_section_alone_decides_where_ranks_run() -> None:
    assert rank_launcher(_launcher(), "hint") == "local"
    assert rank_launcher(_launcher("launcher.kind=slurm", "launcher.nnodes=4"), "hint") == "srun"
    assert rank_launcher(_launcher("launcher.kind=slurm", "launcher.ray=true"), "hint") == "ray"
    assert rank_launcher(_launcher("launcher.ray=true", "launcher.nnodes=2"), "hint") == "ray"
    with pytest.raises(ValueError, match=r"launcher.nnodes=2 with launcher.kind=local: .*\(submit it so\)"):
        rank_launcher(_launcher("launcher.nnodes=2"), "submit it so")


def test_ray_ranks_need_their_placement(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="RayRanksPlan"):
        launch_ranks(_wait_for_stop, 1, str(tmp_path), launcher=_launcher("launcher.ray=true"), run_dir=tmp_path,
                     announce="run")


def test_srun_ranks_are_the_steps_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    seen = {}

    def run_srun(fn, world_size, *args, ntasks_per_node, work_dir):
        seen.update(fn=fn, world_size=world_size, args=args, per_node=ntasks_per_node, work_dir=work_dir)
        return ["rank 0's", "rank 1's"]

    monkeypatch.setattr("megatron_sao.platform.srun.run_srun", run_srun)
    got = launch_ranks(_wait_for_stop, 2, "x", launcher=_launcher("launcher.kind=slurm", "launcher.nproc_per_node=1",
                                                                 "launcher.nnodes=2"),
                       run_dir=tmp_path, announce="run directory: R")
    assert got == "rank 0's"
    assert seen == {"fn": _wait_for_stop, "world_size": 2, "args": ("x",), "per_node": 1,
                    "work_dir": tmp_path / "launch"}
    assert "run directory: R; 2 trainer ranks as srun tasks, 1 per node" in capsys.readouterr().out


def _wait_for_stop(ready_dir: str) -> dict[str, object]:
    """A rank: say it is ready, then wait for SIGTERM (as a trainer rank checkpoints on it)."""
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.set())
    rank = int(os.environ["RANK"])
    (Path(ready_dir) / f"rank{rank}").touch()
    return {"rank": rank, "stopped": stopped.wait(120)}


@pytest.mark.slow  # two spawned ranks: ~30 s on the 2-core box under load
@pytest.mark.timeout(300)
def test_local_ranks_get_the_drivers_stop_signal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM to the driver reaches both local ranks (forwarded), rank 0's result comes back, and
    the driver's own handler is restored afterwards."""
    def stop_when_ready() -> None:
        deadline = time.monotonic() + 240
        while len(list(tmp_path.glob("rank*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_when_ready, daemon=True).start()
    result = launch_ranks(_wait_for_stop, 2, str(tmp_path), launcher=_launcher("launcher.nproc_per_node=2"),
                          run_dir=tmp_path, announce="run directory: R")
    assert result == {"rank": 0, "stopped": True}
    assert signal.getsignal(signal.SIGTERM) is before and launch.forward_to_children is not before
    assert capsys.readouterr().out.startswith("run directory: R\n")
