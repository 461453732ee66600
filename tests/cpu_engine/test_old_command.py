"""`python -m megatron_sao.rollout.cpu_engine`, the documented command's old name, still runs the engine
(now `megatron_sao.cpu_engine`), and nothing in the library imports the engine package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_old_module_name_runs_the_engine_command() -> None:
    done = subprocess.run([sys.executable, "-m", "megatron_sao.rollout.cpu_engine", "--help"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "usage: python -m megatron_sao.cpu_engine" in done.stdout
    assert "--enable-return-routed-experts" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "megatron_sao.rollout.cpu_engine"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert bad.returncode == 2 and "--model" in bad.stderr


def test_nothing_in_the_library_imports_the_cpu_engine() -> None:
    importers = []
    for path in (REPO / "megatron_sao").rglob("*.py"):
        if path.is_relative_to(REPO / "megatron_sao" / "cpu_engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "megatron_sao.cpu_engine" or n.startswith("megatron_sao.cpu_engine.") for n in names):
                importers.append(str(path.relative_to(REPO)))
    assert importers == []
