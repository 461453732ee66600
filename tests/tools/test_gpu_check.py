"""tools/gpu_check.sh, the prepared H200 acceptance run, as far as a CPU machine can take it: the
carried wheel set is exactly the project's pins, names what is missing, stays under the device
tool's 64 MiB, and (slow, needs PyPI) downloads, installs and runs all three checks on CPU with
only the H200 image's packages and those wheels importable."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check.sh"


def _prepare():
    spec = importlib.util.spec_from_file_location("gpu_check_prepare", ROOT / "tools" / "gpu_check" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str, wheels: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(TOOL), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(wheels), **env})


def test_the_carried_wheels_are_the_pins_this_environment_runs() -> None:
    carried = _prepare().carried()
    assert {"megatron-core", "megatron-bridge", "transformers"} <= set(carried)
    assert "torch" not in carried  # the H200's own torch 2.11 stays: nothing carried may replace it
    for name, version in carried.items():
        assert metadata.version(name) == version, name
    assert carried["megatron-core"] == "0.19.2" and carried["megatron-bridge"] == "0.6.2"


def test_the_wheel_check_names_what_is_missing_or_twice(tmp_path: Path) -> None:
    prepare = _prepare()
    problems = prepare.check(tmp_path)
    assert f"missing wheel: megatron-core=={prepare.carried()['megatron-core']}" in problems
    for name, version in prepare.carried().items():
        (tmp_path / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").touch()
    assert prepare.check(tmp_path) == []
    (tmp_path / "transformers-5.17.0-py3-none-any.whl").touch()
    assert prepare.check(tmp_path) == ["transformers: 2 wheels (5.12.1, 5.17.0); one version may travel"]


def test_the_script_fails_clearly_without_its_wheels_or_a_gpu(tmp_path: Path) -> None:
    dry = _run("--dry", wheels=tmp_path / "none")
    assert dry.returncode == 2
    assert "gpu_check: missing wheel: megatron-core==0.19.2 (run `tools/gpu_check.sh --prepare`" in dry.stderr
    if not _has_cuda():
        gpu = _run(wheels=tmp_path / "none")
        assert gpu.returncode == 2 and "no CUDA device" in gpu.stderr
    assert _run("--bogus", wheels=tmp_path).returncode == 2


def test_the_h200_simulation_refuses_what_the_image_lacks(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for wheel in ("uvicorn-0.54.0-py3-none-any.whl", "fastapi-0.165.0-py3-none-any.whl"):
        (wheels / wheel).touch()
    script = tmp_path / "imports.py"
    script.write_text("import json, yaml, uvicorn\nprint('imported')\nfor name in ('ray', 'fastapi'):\n    try:\n"
                      "        __import__(name)\n    except ImportError as e:\n        print('refused:', e)\n")
    proc = subprocess.run([sys.executable, str(ROOT / "tools/gpu_check/h200_sim.py"), str(wheels), str(script)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "imported" in proc.stdout, proc.stderr  # stdlib, the image's pyyaml, a carried uvicorn
    assert "refused: No module named 'ray': its distribution ['ray'] is neither on the H200 image" in proc.stdout
    # fastapi is carried here but starlette, which it imports, is not: named as the image would fail
    assert "refused: No module named 'starlette'" in proc.stdout


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _pypi_reachable() -> bool:
    import socket

    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_prepare_downloads_under_64_mib_and_the_dry_run_passes_every_check(tmp_path: Path) -> None:
    if not _pypi_reachable():
        pytest.skip("PyPI is not reachable from this machine (the preparation downloads from it)")
    wheels = tmp_path / "wheels"
    prepared = _run("--prepare", wheels=wheels, timeout=900)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert "together" in prepared.stdout and "of 64 MiB" in prepared.stdout
    assert _prepare().check(wheels) == []
    dry = _run("--dry", wheels=wheels, timeout=3000, OUT=str(tmp_path / "out"))
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert dry.returncode == 0, "\n".join(summary) + dry.stderr[-3000:]
    assert [line.split(":")[0] for line in summary] == [
        "gpu_check (a) sao_step [dry run", "gpu_check (b) round_trip [dry run", "gpu_check (c) ipc_update [dry run"]
    assert all(": PASS " in line for line in summary), summary
