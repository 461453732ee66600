"""Run a function once per Slurm task (`srun`), as `platform.spawn` runs it on local processes.

Inside a Slurm job the trainer ranks of a multi-node run are srun tasks: one step of
`world_size` tasks spread `ntasks_per_node` to a node. Each task adopts Slurm's task variables
as the env:// ones torch.distributed reads (`platform.slurm.adopt_slurm_env`: RANK, WORLD_SIZE,
LOCAL_RANK; MASTER_ADDR and MASTER_PORT come from the job script, which exports the head node's
advertised IP and a port of the job's block), calls the function and writes its result (or its
traceback) into a directory every node sees (the run directory). The caller gets the per-rank
results in rank order, or RankFailed with the failing ranks' tracebacks (`RankUserError` for a
user error), like `run_distributed`.

Why a step and files rather than Ray actors: the trainer needs one process per GPU with NCCL
between them, which is what srun gives; `--kill-on-bad-exit` turns one crashed rank into a failed
step instead of the others hanging in a collective.

Signals: srun turns a SIGTERM / SIGINT it receives into SIGKILL for its tasks ("forcing job
termination"), which would lose the trainer's checkpoint-on-SIGTERM. So SIGTERM / SIGINT
reaching the caller go to srun as SIGUSR2, which srun forwards unchanged, and each task turns
SIGUSR2 into its own SIGTERM handler's call (`STOP_SIGNAL`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_sao.platform.slurm import adopt_slurm_env
from megatron_sao.platform.spawn import rank_failure, user_error_of
from megatron_sao.utils.atomic import atomic_write_bytes

STOP_SIGNAL = signal.SIGUSR2
"""What the caller sends srun for a graceful stop; tasks treat it as SIGTERM."""


def srun_command(payload: Path, world_size: int, ntasks_per_node: int, python: str = sys.executable,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """The srun line of one rank step: `world_size` tasks, `ntasks_per_node` per node, sharing the
    allocation with the job's other steps (`--overlap`: the Ray step holds the same CPUs)."""
    if world_size < 1 or ntasks_per_node < 1:
        raise ValueError(f"world_size={world_size} and ntasks_per_node={ntasks_per_node} must be >= 1")
    nodes = -(-world_size // ntasks_per_node)
    return ["srun", "--overlap", f"--nodes={nodes}", f"--ntasks={world_size}",
            f"--ntasks-per-node={min(ntasks_per_node, world_size)}", "--kill-on-bad-exit=1", *extra,
            python, "-m", "megatron_sao.platform.srun", str(payload)]


def run_srun(fn: Callable[..., Any], world_size: int, *args: Any, ntasks_per_node: int, work_dir: Path,
             srun_extra: tuple[str, ...] = ()) -> list[Any]:
    """Call `fn(*args)` on `world_size` srun tasks of the current job; the per-rank results in rank
    order. `work_dir` must be visible from every node; `fn` importable, args and result picklable."""
    step_dir = Path(work_dir) / f"ranks-{os.environ.get('SLURM_JOB_ID', 'nojob')}-{uuid.uuid4().hex[:8]}"
    step_dir.mkdir(parents=True)
    payload = step_dir / "payload.pkl"
    payload.write_bytes(pickle.dumps((fn, args)))
    proc = subprocess.Popen(srun_command(payload, world_size, ntasks_per_node, extra=srun_extra))

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(STOP_SIGNAL)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    results: dict[int, Any] = {}
    failures: list[tuple[int, str, str | None]] = []
    for rank in range(world_size):
        out = step_dir / f"rank{rank}.pkl"
        if not out.is_file():
            continue
        ok, value, user_error = pickle.loads(out.read_bytes())
        if ok:
            results[rank] = value
        else:
            failures.append((rank, value, user_error))
    missing = sorted(set(range(world_size)) - set(results))
    if missing and not failures:
        failures.append((missing[0], f"rank(s) {missing} ended without a result (srun exit {code})", None))
    if failures:
        raise rank_failure(failures)
    return [results[r] for r in range(world_size)]


def _stop_as_sigterm(signum: int, frame: Any) -> None:
    """STOP_SIGNAL in a task: whatever SIGTERM would do here (the trainer's checkpoint-and-stop)."""
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        handler(signal.SIGTERM, frame)
    else:
        os.kill(os.getpid(), signal.SIGTERM)


def _task_main(payload: Path) -> int:
    """One srun task: adopt the rank, initialise torch.distributed, run, write the result."""
    import logging
    import socket
    import traceback
    import warnings

    signal.signal(STOP_SIGNAL, _stop_as_sigterm)
    adopt_slurm_env()
    rank = int(os.environ.get("RANK", "0"))
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"sao: rank {rank}/{os.environ.get('WORLD_SIZE', '1')} on node {node}", flush=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, force=True,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    for noisy in ("megatron.core", "megatron.bridge", "modelopt"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    out = payload.parent / f"rank{rank}.pkl"
    from megatron_sao.platform.distributed import destroy_distributed, init_distributed

    try:
        fn, args = pickle.loads(payload.read_bytes())
        init_distributed()
        record = (True, fn(*args), None)
    except BaseException as error:  # every failure goes back to the caller, named by rank
        record = (False, traceback.format_exc(), user_error_of(error))
    finally:
        with contextlib.suppress(Exception):
            destroy_distributed()
    atomic_write_bytes(out, pickle.dumps(record), durable=False)  # read once by the launcher, then deleted
    return 0 if record[0] else 1


if __name__ == "__main__":
    sys.exit(_task_main(Path(sys.argv[1])))
