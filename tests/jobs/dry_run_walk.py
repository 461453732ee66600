"""Run many `sao ... --dry-run` commands in ONE fresh process (Megatron, megatron-bridge and
transformers import once) and record each one's exit code, output and time.

    python -m tests.jobs.dry_run_walk OUT_DIR '[["train", "recipes/tiny_cpu.yaml", "--dry-run"], ...]'

Writes OUT_DIR/<i>.out and OUT_DIR/<i>.err (file descriptors 1 and 2 of command i, so what
`sao` prints on its console lands there) and OUT_DIR/results.json ([{"code", "seconds", "cpu_seconds"}, ...]).
A fresh process because the CPU shims and the fake process group are process-wide.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def _fds_to(out: Path, err: Path) -> Iterator[None]:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with out.open("w") as out_file, err.open("w") as err_file:
        os.dup2(out_file.fileno(), 1)
        os.dup2(err_file.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def main(argv: list[str]) -> int:
    from megatron_sao.cli import main as sao

    out_dir, commands = Path(argv[0]), json.loads(argv[1])
    results = []
    for i, command in enumerate(commands):
        start, cpu_start = time.perf_counter(), time.process_time()
        with _fds_to(out_dir / f"{i}.out", out_dir / f"{i}.err"):
            code = sao(command)
        results.append({"code": code, "seconds": round(time.perf_counter() - start, 2),
                        "cpu_seconds": round(time.process_time() - cpu_start, 2)})
    (out_dir / "results.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
