"""platform/srun.py without a cluster: Slurm task variables adopted as torch.distributed's, the srun
line of a rank step, and SIGUSR2 (what srun forwards) turned into the task's SIGTERM handler."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from megatron_sao.platform.srun import STOP_SIGNAL, _stop_as_sigterm, adopt_slurm_env, srun_command

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
            "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_slurm_task_variables_become_the_rank(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLURM_PROCID", "5")
    clean_env.setenv("SLURM_NTASKS", "8")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    clean_env.setenv("MASTER_ADDR", "10.0.0.1")
    clean_env.setenv("MASTER_PORT", "20002")
    assert adopt_slurm_env()
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")] == ["5", "8", "1", "4"]


def test_torchrun_variables_win_and_a_single_task_is_left_alone(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")
    assert not adopt_slurm_env() and "RANK" not in os.environ
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("SLURM_NTASKS", "16")
    assert adopt_slurm_env() and os.environ["RANK"] == "3"


def test_several_tasks_without_a_rendezvous_address_are_refused(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLURM_PROCID", "1")
    clean_env.setenv("SLURM_NTASKS", "2")
    with pytest.raises(ValueError, match="MASTER_ADDR / MASTER_PORT are not set"):
        adopt_slurm_env()


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
