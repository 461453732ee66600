"""The wheels tools/gpu_check.sh carries to the H200, and their checks. Standard library only: the
same file checks the folder on the H200 before anything is installed.

    python tools/gpu_check/prepare.py download .gpu_wheels   # here, with PyPI: pip download --no-deps
    python tools/gpu_check/prepare.py check .gpu_wheels      # anywhere: every wheel there, one version each

The list is wheels.txt beside this file: a package name takes its exact pin from the project's
requirements files (requirements.txt, requirements-nodeps.txt, requirements-test.txt,
constraints.txt); a `name==version` there pins what those files leave to pip (a dependency of a
pinned package, at the version the CPU environment runs). Wheels are for CPython 3.12 on x86-64
manylinux (the H200's Python); `download` removes any other file from the folder, so that one
version of each travels. The folder and the tracked working tree together must stay within the
device tool's 64 MiB per call.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REQUIREMENT_FILES = ("requirements.txt", "requirements-nodeps.txt", "requirements-test.txt", "constraints.txt")
LIMIT_BYTES = 64 * 2**20  # the device tool: working tree + carried paths, per call
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for name in REQUIREMENT_FILES:
        for line in (ROOT / name).read_text().splitlines():
            match = re.match(r"^\s*([A-Za-z0-9_.\-\[\]]+)\s*==\s*([^\s;#]+)", line)
            if match:
                pins[normalize(match[1].split("[")[0])] = match[2]
    return pins


def carried() -> dict[str, str]:
    """normalized name -> exact version, in wheels.txt's order; ValueError for a name no file pins."""
    pins, out = project_pins(), {}
    for raw in (HERE / "wheels.txt").read_text().splitlines():
        line = raw.split("#")[0].strip()
        if not line:
            continue
        name, _, version = (part.strip() for part in line.partition("=="))
        version = version or pins.get(normalize(name), "")
        if not version:
            raise ValueError(f"wheels.txt: {name} has no version and no exact pin in {', '.join(REQUIREMENT_FILES)}")
        out[normalize(name)] = version
    return out


def _wheel_key(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return normalize(name), version


def check(folder: Path) -> list[str]:
    """Problems with `folder` against the list: a missing wheel, another version, a stray file."""
    wanted = carried()
    found: dict[str, list[str]] = {}
    for wheel in folder.glob("*.whl") if folder.is_dir() else []:
        name, version = _wheel_key(wheel)
        found.setdefault(name, []).append(version)
    problems = [f"missing wheel: {name}=={version}" for name, version in wanted.items()
                if version not in found.get(name, [])]
    problems += [f"{name}: {len(versions)} wheels ({', '.join(sorted(versions))}); one version may travel"
                 for name, versions in found.items() if len(versions) > 1]
    problems += [f"not in wheels.txt: {name}=={', '.join(versions)}" for name, versions in found.items()
                 if name not in wanted]
    return problems


def tracked_bytes() -> int:
    """Bytes of the files git tracks (the working tree the device tool sends)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def download(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    wanted = carried()
    for stray in folder.iterdir():  # other versions, other packages, partial downloads
        if stray.suffix != ".whl" or wanted.get(_wheel_key(stray)[0]) != _wheel_key(stray)[1]:
            stray.unlink()
    missing = [f"{name}=={version}" for name, version in wanted.items()
               if not any(_wheel_key(w) == (name, version) for w in folder.glob("*.whl"))]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "-d", str(folder), *missing]
        subprocess.run(cmd, check=True)
    problems = check(folder)
    wheels = sum(w.stat().st_size for w in folder.glob("*.whl"))
    tree = tracked_bytes()
    print(f"{len(wanted)} wheels in {folder}: {wheels / 2**20:.1f} MiB; tracked working tree {tree / 2**20:.1f} MiB; "
          f"together {(wheels + tree) / 2**20:.1f} of {LIMIT_BYTES / 2**20:.0f} MiB")
    if wheels + tree > LIMIT_BYTES:
        problems.append(f"wheels + working tree = {(wheels + tree) / 2**20:.1f} MiB > {LIMIT_BYTES / 2**20:.0f} MiB")
    for problem in problems:
        print(f"prepare: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("download", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    folder = Path(argv[1])
    if argv[0] == "download":
        return download(folder)
    problems = check(folder)
    for problem in problems:
        print(f"gpu_check: {problem} (run `tools/gpu_check.sh --prepare` where PyPI is reachable, then carry "
              f"{folder})", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
