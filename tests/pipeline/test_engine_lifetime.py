"""`sao train recipes/tiny_cpu_engine.yaml` (a CPU engine rolling out for the trainer) ended every
way a run ends: nothing it started survives it. A new user saw the CPU engine of a run whose rank
was killed stay alive, re-parented to init, holding 1 GB.

Each run is a driver process tagged with a fresh SAO_RUN_ID (inherited by the ranks, the engine,
Megatron's checkpoint helpers, Ray's processes); it is ended once its first checkpoint is written
(so every kind of process exists), and then no live process may carry the id. The issue's own
case (SIGKILL of the rank that holds the engine) runs in the default suite; the other ways, and
the same on Ray, are slow.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_sao.rollout.envs.calc import write_calc_dataset
from tests.platform.lifetime_jobs import REPO, new_run_env, tagged, wait_for_file, wait_for_none

SECONDS = 15.0
"""Within how long everything must be gone once the run has ended (driver exited or killed). The
driver of a run whose rank died gives the other ranks 5 s before it kills them."""


def _overrides(tmp_path: Path, hf_dir: Path, *more: str) -> list[str]:
    prompts = write_calc_dataset(tmp_path / "calc.jsonl", 64, seed=0)
    return [f"run.output_dir={tmp_path}", "run.name=run", f"model.hf_path={hf_dir}", f"data.train_path={prompts}",
            "launcher.nproc_per_node=1", "parallelism.expert=1", "logging.wandb_mode=disabled",
            "logging.param_table=false", "rollout.max_new_tokens_per_turn=12", "rollout.max_total_tokens=320",
            "rollout.max_inflight_per_engine=8", "data.batch_size=4", "critic.warmup_steps=1",
            "checkpoint.save_every=1", "run.total_steps=40", *more]


def _start(tmp_path: Path, hf_dir: Path, *more: str, raising: bool = False) -> tuple[subprocess.Popen, str]:
    run, env = new_run_env()
    recipe = str(REPO / "recipes" / "tiny_cpu_engine.yaml")
    driver = ["-m", "tests.platform.lifetime_jobs", "train-raising", str(tmp_path)] if raising else \
        ["-m", "megatron_sao.cli", "train"]
    proc = subprocess.Popen([sys.executable, *driver, recipe, *_overrides(tmp_path, hf_dir, *more)], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, run


def _first_checkpoint(proc: subprocess.Popen, tmp_path: Path) -> None:
    """Wait until the run has saved once: ranks, engine and the checkpoint writer's helpers exist."""
    tracker = tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        wait_for_file(tracker, 600, proc)
    except AssertionError:
        raise AssertionError(proc.communicate()[0][-3000:]) from None


def _engine_alive(run: str) -> bool:
    return any("megatron_sao.cpu_engine" in c for c in tagged(run).values())


def _ended(proc: subprocess.Popen, run: str, code: int | None) -> float:
    out = proc.communicate(timeout=600)[0]
    if code is not None:
        assert proc.returncode == code, out[-3000:]
    waited, left = wait_for_none(run, SECONDS)
    assert not left, f"still alive {waited:.1f} s after the run ended: {left}"
    print(f"lifetime: nothing left {waited:.1f} s after the driver exited ({proc.returncode})")
    return waited


def _rank(proc: subprocess.Popen, run: str, ray: bool) -> psutil.Process:
    """The trainer rank process (a spawned child of the driver, or the Ray actor's worker)."""
    if ray:
        found = [psutil.Process(pid) for pid, cmd in tagged(run).items() if cmd.startswith("ray::_RankWorker")]
    else:
        found = [p for p in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.timeout(900)
def test_killed_rank_leaves_no_engine(tmp_path, tiny_hf_dir):
    """The issue's case: SIGKILL of the trainer rank that started the CPU engine."""
    proc, run = _start(tmp_path, tiny_hf_dir)
    _first_checkpoint(proc, tmp_path)
    assert _engine_alive(run)
    started = time.monotonic()
    _rank(proc, run, ray=False).kill()
    _ended(proc, run, code=None)
    assert proc.returncode != 0
    print(f"lifetime: rank_sigkill: nothing left {time.monotonic() - started:.1f} s after the kill")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("way", ["exit", "exception", "sigterm", "driver_sigkill"])
def test_run_ending_leaves_nothing(tmp_path, tiny_hf_dir, way):
    if way == "exit":
        proc, run = _start(tmp_path, tiny_hf_dir, "run.total_steps=2")
        _ended(proc, run, code=0)
        return
    proc, run = _start(tmp_path, tiny_hf_dir, raising=way == "exception")
    if way == "exception":  # the rank raises in its second step, after the first checkpoint
        _ended(proc, run, code=None)
        assert proc.returncode != 0
        return
    _first_checkpoint(proc, tmp_path)
    assert _engine_alive(run)
    if way == "sigterm":  # checkpoint-and-stop: the driver exits 143, the engine is stopped
        proc.send_signal(signal.SIGTERM)
        _ended(proc, run, code=143)
        return
    proc.kill()
    proc.wait()
    waited, left = wait_for_none(run, SECONDS)
    assert not left, f"still alive {waited:.1f} s after the driver was killed: {left}"
    print(f"lifetime: nothing left {waited:.1f} s after the driver was killed")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("way", ["driver_sigkill", "rank_sigkill"])
def test_ray_run_ending_leaves_nothing(tmp_path, tiny_hf_dir, way):
    """The same on a local Ray instance (`launcher.ray=true`): trainer rank, rollout actor and
    engine host as actors, Ray's own processes tagged too."""
    proc, run = _start(tmp_path, tiny_hf_dir, "launcher.ray=true")
    _first_checkpoint(proc, tmp_path)
    assert _engine_alive(run)
    started = time.monotonic()
    if way == "driver_sigkill":
        proc.kill()
        proc.wait()
    else:
        _rank(proc, run, ray=True).kill()
        proc.communicate(timeout=600)
        assert proc.returncode != 0
    _, left = wait_for_none(run, SECONDS)
    assert not left, f"still alive {time.monotonic() - started:.1f} s after the {way}: {left}"
    print(f"lifetime: ray {way}: nothing left {time.monotonic() - started:.1f} s after it")
