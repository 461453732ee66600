"""platform/srun.py without a cluster: the srun line of a rank step, and SIGUSR2 (what srun forwards)
turned into the task's SIGTERM handler. The Slurm variables a task adopts: tests/platform/test_slurm.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from megatron_sao.platform.srun import STOP_SIGNAL, _stop_as_sigterm, srun_command


def test_rank_step_line(tmp_path: Path) -> None:
    line = srun_command(tmp_path / "payload.pkl", world_size=12, ntasks_per_node=8, python="py")
    assert line[:6] == ["srun", "--overlap", "--nodes=2", "--ntasks=12", "--ntasks-per-node=8", "--kill-on-bad-exit=1"]
    assert line[-4:] == ["py", "-m", "megatron_sao.platform.srun", str(tmp_path / "payload.pkl")]
    assert "--ntasks-per-node=2" in srun_command(tmp_path / "p", world_size=2, ntasks_per_node=8)
    with pytest.raises(ValueError):
        srun_command(tmp_path / "p", world_size=0, ntasks_per_node=8)


def test_stop_signal_calls_the_sigterm_handler() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        _stop_as_sigterm(STOP_SIGNAL, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM]
