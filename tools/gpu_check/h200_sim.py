"""Run a Python script or module here as if on the bare H200: only the image's packages
(h200_packages.txt) and the carried wheels may be imported.

    python tools/gpu_check/h200_sim.py WHEEL_DIR SCRIPT.py [ARGS...]
    python tools/gpu_check/h200_sim.py WHEEL_DIR -m MODULE [ARGS...]

Every import of a top-level module that belongs to an installed distribution which is neither
on the image nor a wheel in WHEEL_DIR raises ModuleNotFoundError naming that distribution, the
way it would fail there (optional imports, `try: import x except ImportError`, behave as there).
The repository's own package and the standard library are always importable. Versions are this
environment's (the pins); which versions the image holds is read from h200_packages.txt by
prepare.py, not simulated here. Subprocesses started through common.python_cmd() inherit it.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as metadata
import os
import re
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = (HERE / "h200_packages.txt").read_text().splitlines()
    return {normalize(line.split("==")[0].strip()) for line in lines if line.strip() and not line.startswith("#")}


def carried_packages(wheel_dir: Path) -> set[str]:
    return {normalize(w.name.split("-")[0]) for w in wheel_dir.glob("*.whl")}


class H200Imports(importlib.abc.MetaPathFinder):
    """Refuses top-level modules of distributions the H200 would not have."""

    def __init__(self, allowed: set[str]) -> None:
        self.allowed = allowed
        self.owners = {module: {normalize(d) for d in dists}
                       for module, dists in metadata.packages_distributions().items()}

    def find_spec(self, fullname, path=None, target=None):
        if "." in fullname or fullname in sys.stdlib_module_names:
            return None
        owners = self.owners.get(fullname)
        if owners and not owners & self.allowed:
            raise ModuleNotFoundError(f"No module named {fullname!r}: its distribution {sorted(owners)} is neither "
                                      "on the H200 image (tools/gpu_check/h200_packages.txt) nor carried "
                                      "(tools/gpu_check/wheels.txt)", name=fullname)
        return None


def install(wheel_dir: Path) -> None:
    allowed = image_packages() | carried_packages(wheel_dir) | {"megatron-sao"}
    sys.meta_path.insert(0, H200Imports(allowed))
    os.environ["SAO_H200_SIM"] = str(wheel_dir)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    install(Path(argv[0]))
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path.insert(0, str(Path(argv[1]).resolve().parent))
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
