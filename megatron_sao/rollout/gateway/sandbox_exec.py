"""`python -m megatron_sao.rollout.gateway.sandbox_exec [--timeout S] [--memory-mb M]`: run the
Python code on stdin in the rollout sandbox (`rollout/sandbox/`: no network, read-only
filesystem, private /tmp, resource limits) and print its merged output.

Scaffolds behind the gateway reach it through `$SAO_SANDBOX_EXEC` to execute model-written code
the way the shipped environments do. Exit code 0 when the code ran cleanly, 1 otherwise (the
reason is printed after the output, as the model should see it). Each call is a fresh sandbox:
nothing persists between calls except what the code prints.
"""

from __future__ import annotations

import argparse
import sys

from megatron_sao.rollout.sandbox import run_python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=30.0, help="wall-clock seconds")
    parser.add_argument("--memory-mb", type=int, default=1024, help="address-space limit per process")
    args = parser.parse_args(argv)
    result = run_python(sys.stdin.read(), timeout_s=args.timeout, memory_mb=args.memory_mb)
    sys.stdout.write(result.output)
    if not result.ok:
        sys.stdout.write(f"\n[sandbox: {result.error}]\n")
    sys.stdout.flush()
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
