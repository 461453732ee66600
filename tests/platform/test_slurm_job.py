"""platform/slurm_job.py without the `sao launch` command line: a resolved config and the job's
options (`JobOptions`) make the script and its own submission directory; a script that fails its
checks leaves none. The flags' mapping onto these is tests/launchers/test_slurm_script.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_sao.config import load_config
from megatron_sao.platform.slurm_job import REPO, JobOptions, driver_command, submission_dir, write_job_script

TINY = REPO / "recipes" / "tiny_cpu.yaml"


def test_a_config_and_options_make_the_script_in_its_own_directory(tmp_path: Path) -> None:
    config = load_config(TINY, [f"run.output_dir={tmp_path}", "launcher.kind=slurm", "launcher.nnodes=2"])
    run_dir = tmp_path / "tiny_cpu"
    script = write_job_script(config, JobOptions(driver_command="config show", cpus_per_node=3), run_dir, True)
    assert script == submission_dir(run_dir, dry_run=True) / "sao_job.sbatch"
    text = script.read_text()
    config_path = script.parent / "config.yaml"
    assert "CPUS_PER_NODE=3" in text and "HET=0" in text and "#SBATCH --nodes=2" in text
    assert f"DRIVER=({sys.executable} -m megatron_sao.cli config show {config_path} checkpoint.resume=auto)" in text
    assert load_config(config_path, []).launcher.nnodes == 2
    submitted = submission_dir(run_dir, dry_run=False)
    assert submitted.parent == run_dir / "launch" and submitted.name.startswith("submit-")


def test_a_script_that_fails_its_checks_leaves_no_directory(tmp_path: Path) -> None:
    config = load_config(TINY, [f"run.output_dir={tmp_path}", "launcher.kind=slurm"])
    run_dir = tmp_path / "tiny_cpu"
    with pytest.raises(ValueError, match="--engine-nodes needs --engine-partition"):
        write_job_script(config, JobOptions(engine_nodes=1), run_dir, dry_run=True)
    assert not (run_dir / "launch" / "dry-run").exists()


def test_a_convert_driver_runs_one_srun_task_per_rank() -> None:
    words = driver_command("convert verify --hf a --mcore b", "python", Path("c.yaml"), nodes=2, tasks_per_node=4)
    assert words[:6] == ["srun", "--overlap", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--kill-on-bad-exit=1"]
    assert words[-6:] == ["convert", "verify", "--hf", "a", "--mcore", "b"]
    with pytest.raises(ValueError, match="--command is empty"):
        driver_command("  ", "python", Path("c.yaml"), 1, 1)
