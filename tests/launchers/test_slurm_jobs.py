"""`sao launch slurm` on a real (local, two-node) Slurm: the tiny recipe end to end with one trainer
rank per node and Ray across both, through the time-limit signal -> checkpoint -> requeue ->
resume; a failing job's exit code and message; slow: an uninterrupted run, scancel -> checkpoint,
a node dying mid-run, a heterogeneous job.
The cluster comes from the `local_slurm` fixture (tests/launchers/conftest.py)."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from megatron_sao.cli import main
from megatron_sao.platform.slurm_job import job_state, wait_for_job
from megatron_sao.rollout.trajectory_io import write_parquet
from tests.training.trajectories import random_trajectories

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("slurm_recorded") / "trajectories.parquet"
    write_parquet(path, random_trajectories(64, seed=5))
    return path


def _overrides(tmp_path: Path, trajectories: Path, steps: int, *more: str) -> list[str]:
    # One trainer rank per emulated node (EP 2 across the two nodes). critic.warmup_steps=0: the
    # actor's optimizer has state from step 1 on, so a checkpoint at any step can be written.
    return [f"run.output_dir={tmp_path}", f"data.trajectories_path={trajectories}", f"run.total_steps={steps}",
            "launcher.nproc_per_node=1", "critic.warmup_steps=0", "logging.wandb_mode=disabled",
            "logging.param_table=false", *more]


def _log(tmp_path: Path, job_id: str) -> str:
    return (tmp_path / "tiny_cpu" / f"slurm-{job_id}.out").read_text(errors="replace")


def _steps(tmp_path: Path) -> list[int]:
    path = tmp_path / "tiny_cpu" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def _submitted(out: str) -> str:
    return re.search(r"submitted job (\d+)", out)[1]


@pytest.mark.timeout(300)
def test_failing_job_exits_non_zero_with_its_message(local_slurm: int, trajectories: Path, tmp_path: Path,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    # A file whose schema the launch checks, but whose every token id is outside the model's
    # vocabulary: the srun ranks find that as they read it, and it stays a user error (exit 2, its
    # own message once).
    out_of_vocab = tmp_path / "out_of_vocab.parquet"
    write_parquet(out_of_vocab, random_trajectories(8, seed=4, vocab=1_000_000))
    code = main(["launch", "slurm", RECIPE, *_overrides(tmp_path, trajectories, 2),
                 f"data.trajectories_path={out_of_vocab}", "--nodes", "2", "--allow-loopback", "--wait"])
    captured = capfd.readouterr()
    assert code == 2
    assert "ended: FAILED, exit 2" in captured.out
    assert f"sao train: error: trajectory file {out_of_vocab} has no valid trajectory" in captured.err


def _wait_for_step(tmp_path: Path, job_id: str, step: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(s >= step for s in _steps(tmp_path)):
        state, _ = job_state(job_id)
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {job_id} {state}:\n{_log(tmp_path, job_id)}"
        assert time.monotonic() < deadline, f"no step {step} after {timeout_s} s:\n{_log(tmp_path, job_id)}"
        time.sleep(1)


@pytest.mark.slow  # ~3 min: the longest default-suite test (the failing-job test keeps Slurm in it)
@pytest.mark.timeout(420)
def test_tiny_recipe_across_two_nodes_checkpoints_on_time_limit_and_resumes_after_requeue(
        local_slurm: int, trajectories: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`sao launch slurm recipes/tiny_cpu.yaml --nodes 2 --requeue --wait`, one trainer rank per node,
    Ray across both; the time-limit warning mid-run -> checkpoint -> requeue -> resume -> exit 0."""
    total = 20  # ~0.2 s a step once warm: the signal lands mid-run
    launched: dict[str, int] = {}
    command = ["launch", "slurm", RECIPE, *_overrides(tmp_path, trajectories, total, "checkpoint.save_every=0"),
               "--nodes", "2", "--allow-loopback", "--requeue", "--wait"]
    waiter = threading.Thread(target=lambda: launched.update(code=main(command)))
    waiter.start()
    out = ""
    while not (found := re.search(r"submitted job (\d+)", out)):
        assert waiter.is_alive(), out
        time.sleep(0.5)
        out += capsys.readouterr().out
    job = found[1]
    _wait_for_step(tmp_path, job, 1)
    # What Slurm sends 120 s before the time limit (#SBATCH --signal=B:USR1@120), sent now.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    waiter.join(timeout=360)
    out += capsys.readouterr().out
    log = _log(tmp_path, job)
    assert launched.get("code") == 0, log[-3000:]
    assert f"job {job} ended: COMPLETED, exit 0" in out
    assert "Ray cluster complete: 2 nodes" in log
    assert "sao: rank 0/2 on node node1" in log and "sao: rank 1/2 on node node2" in log
    stopped = re.search(r"rl stopped by a signal after its checkpoint; rerun to resume at step (\d+)", log)
    assert stopped, log[-3000:]
    step = int(stopped[1])
    assert 1 <= step < total
    assert "got SIGUSR1" in log and "driver exited with 143" in log and f"requeueing job {job}" in log
    assert "(restart 1)" in log
    assert f"resuming from {tmp_path / 'tiny_cpu' / 'checkpoints' / f'iter_{step:07d}'}" in log
    assert f"rl finished at step {total}" in log and "driver exited with 0" in log
    assert _steps(tmp_path) == list(range(1, total + 1))  # the resumed run continues, no step repeated


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_recipe_runs_across_two_nodes(local_slurm: int, trajectories: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["launch", "slurm", RECIPE, *_overrides(tmp_path, trajectories, 2), "--nodes", "2",
                 "--allow-loopback", "--wait"])
    out = capsys.readouterr().out
    job = _submitted(out)
    log = _log(tmp_path, job)
    assert code == 0, log[-3000:]
    assert f"job {job} ended: COMPLETED, exit 0" in out
    assert re.search(r"Ray cluster complete: 2 nodes", log)
    assert "sao: rank 0/2 on node node1" in log and "sao: rank 1/2 on node node2" in log
    assert "rl finished at step 2" in log and "driver exited with 0" in log
    assert _steps(tmp_path) == [1, 2]
    assert (tmp_path / "tiny_cpu" / "checkpoints" / "iter_0000002").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_scancel_checkpoints_before_the_job_ends(local_slurm: int, trajectories: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "slurm", RECIPE, *_overrides(tmp_path, trajectories, 50, "checkpoint.save_every=0"),
                 "--nodes", "2", "--allow-loopback"]) == 0
    job = _submitted(capsys.readouterr().out)
    _wait_for_step(tmp_path, job, 1)
    subprocess.run(["scancel", job], check=True)
    assert wait_for_job(job, tmp_path / "tiny_cpu", poll_s=1.0) != 0
    log = _log(tmp_path, job)
    stopped = re.search(r"stopped by a signal after its checkpoint; rerun to resume at step (\d+)", log)
    assert stopped, log[-3000:]
    assert (tmp_path / "tiny_cpu" / "checkpoints" / f"iter_{int(stopped[1]):07d}").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engines_on_another_partition_run_as_a_heterogeneous_job(local_slurm: int, trajectories: Path,
                                                                 tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Trainer node + engine node as the two components of one Slurm job; Ray spans both and the
    engine node offers the sao_engine resource (here both come from the one test partition)."""
    code = main(["launch", "slurm", RECIPE, *_overrides(tmp_path, trajectories, 2), "--nodes", "2",
                 "--engine-partition", "debug", "--engine-nodes", "1", "--allow-loopback", "--command", "config show",
                 "--wait"])
    out = capsys.readouterr().out
    job = _submitted(out)
    log = _log(tmp_path, job)
    assert code == 0, log[-3000:]
    assert re.search(r"on 2 nodes: node(\d) \+ engine nodes node(?!\1)\d", log), log[-3000:]
    assert "Ray cluster complete: 2 nodes" in log and "(1 engine nodes)" in log
    assert "driver exited with 0" in log


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_node_dying_mid_run_fails_the_job_instead_of_hanging(local_slurm: int, trajectories: Path,
                                                                tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "slurm", RECIPE, *_overrides(tmp_path, trajectories, 500, "checkpoint.save_every=0"),
                 "--nodes", "2", "--allow-loopback"]) == 0
    job = _submitted(capsys.readouterr().out)
    _wait_for_step(tmp_path, job, 1)
    # Node 2's part of the Ray step (step 1: step 0 resolved the head's IP) dies as with a node failure.
    pids = subprocess.run(["scontrol", "listpids", f"{job}.1", "node2"], capture_output=True, text=True).stdout
    ray = [int(line.split()[0]) for line in pids.splitlines()[1:] if line.split() and line.split()[0].isdigit()]
    assert ray, pids
    subprocess.run(["kill", "-KILL", *map(str, ray)], check=False)
    started = time.monotonic()
    assert wait_for_job(job, tmp_path / "tiny_cpu", poll_s=1.0) == 4
    assert time.monotonic() - started < 180
    assert "node failure (Ray step ended)" in _log(tmp_path, job)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_training_through_rollout_engines_across_two_nodes(local_slurm: int, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """rollout.source=engine: rank 0 hosts the CPU rollout engine on its node, the trainer ranks on
    both nodes train on its trajectories and push weights back (pipeline/engine_source.py)."""
    recipe = str(Path(RECIPE).with_name("tiny_cpu_engine.yaml"))
    code = main(["launch", "slurm", recipe, f"run.output_dir={tmp_path}", "run.total_steps=3", "critic.warmup_steps=0",
                 "checkpoint.save_every=0", "launcher.nproc_per_node=1", "logging.wandb_mode=disabled", "--nodes", "2",
                 "--allow-loopback", "--wait"])
    log = (tmp_path / "tiny_cpu_engine" / f"slurm-{_submitted(capsys.readouterr().out)}.out").read_text()
    assert code == 0, log[-3000:]
    assert "sao: rank 0/2 on node node1" in log and "sao: rank 1/2 on node node2" in log
    assert "rl finished at step 3" in log and "staleness/mean=" in log
