"""platform/slurm.py's `adopt_slurm_env`: the one rule by which an srun task becomes a
torch.distributed rank, for the trainer's rank steps (platform/srun.py) and for conversions under
srun (platform/run_collective.py). Before, the two had rules of their own: the conversion's took
port 29500 when MASTER_PORT was missing and left LOCAL_WORLD_SIZE unset."""

from __future__ import annotations

import os

import pytest

from megatron_sao.platform import run_collective, srun
from megatron_sao.platform.slurm import adopt_slurm_env

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
            "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def _several_tasks(env: pytest.MonkeyPatch, **more: str) -> None:
    for key, value in {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                       "SLURM_NTASKS_PER_NODE": "4(x2)", **more}.items():
        env.setenv(key, value)


def test_slurm_task_variables_become_the_rank(clean_env: pytest.MonkeyPatch) -> None:
    _several_tasks(clean_env, MASTER_ADDR="10.0.0.1", MASTER_PORT="20002")
    assert adopt_slurm_env()
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")] == ["5", "8", "1", "4"]
    assert os.environ["MASTER_PORT"] == "20002"


def test_torchrun_variables_win_and_a_single_task_is_left_alone(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")
    assert not adopt_slurm_env() and "RANK" not in os.environ
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("SLURM_NTASKS", "16")
    assert adopt_slurm_env() and os.environ["RANK"] == "3" and os.environ["WORLD_SIZE"] == "4"


@pytest.mark.parametrize("given", [{}, {"MASTER_ADDR": "10.0.0.1"}, {"MASTER_PORT": "20002"}])
def test_several_tasks_without_a_full_rendezvous_address_are_refused(clean_env: pytest.MonkeyPatch,
                                                                     given: dict[str, str]) -> None:
    """No default port: two jobs on one node would both take it."""
    _several_tasks(clean_env, **given)
    with pytest.raises(ValueError, match="MASTER_ADDR / MASTER_PORT are not set"):
        adopt_slurm_env()
    assert "RANK" not in os.environ


def test_both_callers_use_the_one_rule(clean_env: pytest.MonkeyPatch) -> None:
    """The rank step's task and a conversion under srun adopt the same variables and refuse the
    same environment (before: the conversion took MASTER_PORT=29500 and no LOCAL_WORLD_SIZE)."""
    assert srun.adopt_slurm_env is adopt_slurm_env
    _several_tasks(clean_env, MASTER_ADDR="10.0.0.1")
    with pytest.raises(ValueError, match="MASTER_ADDR / MASTER_PORT are not set"):
        run_collective.under_launcher()
    clean_env.setenv("MASTER_PORT", "20002")
    assert run_collective.under_launcher()
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")] == [
        "5", "8", "1", "4", "20002"]
