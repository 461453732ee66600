"""Forming a Ray cluster over a job's nodes: start lines, and a join barrier that fails fast.

Reported Ray-on-Slurm failures this answers: the driver starting before every worker joined
(`wait_for_nodes` blocks until N alive nodes with the expected CPUs / GPUs each, or exits
non-zero naming what is missing), wrong CPU counts (CPUs and GPUs are passed explicitly from
Slurm's allocation, never auto-detected from the whole machine), port collisions (every port
from the job's block, see platform/slurm.py).

`python -m megatron_sao.platform.ray_cluster wait --address IP:PORT --nodes N ...` is the
barrier the job script runs.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from megatron_sao.platform.slurm import PortBlock
from megatron_sao.utils.args import SaoArgumentParser

# Offsets in the job's port block (the rest: torch.distributed master, engines, see jobs/launch.py).
GCS = 0
ENGINE_RESOURCE = "sao_engine"
"""Custom Ray resource (1 per node) of the nodes a heterogeneous job gives to rollout engines, so
that engines can be placed there and nothing else is."""


@dataclass(frozen=True, slots=True)
class RayNodeSpec:
    num_cpus: int
    num_gpus: int
    temp_dir: str
    """Per job (Ray keeps one session directory per host; it must not be another job's)."""
    worker_ports: tuple[int, int]
    """Ports for Ray's worker processes, a per-job slice so jobs sharing a node do not collide."""
    engine_node: bool = False
    """An engine node of a heterogeneous job: offers ENGINE_RESOURCE."""


def head_command(ip: str, ports: PortBlock, spec: RayNodeSpec) -> list[str]:
    """`ray start --head` in the foreground (the srun step lives exactly as long as Ray)."""
    return ["ray", "start", "--head", "--block", f"--node-ip-address={ip}", f"--port={ports.port(GCS)}",
            "--include-dashboard=false",
            *_common(ports, spec)]


def worker_command(ip: str, head_address: str, ports: PortBlock, spec: RayNodeSpec) -> list[str]:
    return ["ray", "start", "--block", f"--address={head_address}", f"--node-ip-address={ip}", *_common(ports, spec)]


def _common(ports: PortBlock, spec: RayNodeSpec) -> list[str]:
    # Node- and object-manager ports stay 0 (Ray picks free ones): emulated nodes share a host.
    resources = [f'--resources={{"{ENGINE_RESOURCE}": 1}}'] if spec.engine_node else []
    return [f"--num-cpus={spec.num_cpus}", f"--num-gpus={spec.num_gpus}", f"--temp-dir={spec.temp_dir}",
            f"--min-worker-port={spec.worker_ports[0]}", f"--max-worker-port={spec.worker_ports[1]}", *resources]


def worker_port_range(ports: PortBlock, width: int = 56) -> tuple[int, int]:
    """Ray worker ports of this job (one per worker process): one `width`-port slice of
    30000-64999 per port block, so jobs with different blocks never share worker ports."""
    slot = (ports.first // ports.count) % (35000 // width)
    return 30000 + slot * width, 30000 + slot * width + width - 1


class JoinTimeout(RuntimeError):
    """Not every expected node joined in time."""


def check_nodes(nodes: list[dict], expected: int, cpus_per_node: int, gpus_per_node: int,
                engine_nodes: int = 0) -> str | None:
    """None when `nodes` (ray.nodes()) has `expected` alive nodes with the resources asked for
    (`engine_nodes` of them offering ENGINE_RESOURCE), else what is missing."""
    alive = [n for n in nodes if n.get("Alive")]
    problems = []
    engines = sum(1 for n in alive if n.get("Resources", {}).get(ENGINE_RESOURCE, 0) > 0)
    if engines != engine_nodes:
        problems.append(f"{engines} engine nodes ({ENGINE_RESOURCE}) joined, expected {engine_nodes}")
    if len(alive) < expected:
        problems.append(f"{len(alive)} of {expected} nodes joined "
                        f"({', '.join(sorted(n.get('NodeManagerAddress', '?') for n in alive)) or 'none'})")
    for n in alive:
        res = n.get("Resources", {})
        if res.get("CPU", 0) < cpus_per_node or res.get("GPU", 0) < gpus_per_node:
            problems.append(f"node {n.get('NodeManagerAddress', '?')} has CPU={res.get('CPU', 0):g} "
                            f"GPU={res.get('GPU', 0):g}, expected CPU>={cpus_per_node} GPU>={gpus_per_node}")
    return "; ".join(problems) or None


def wait_for_nodes(address: str, expected: int, cpus_per_node: int, gpus_per_node: int,
                   timeout_s: float, poll_s: float = 2.0, engine_nodes: int = 0) -> list[dict]:
    """Block until the Ray cluster at `address` is complete; JoinTimeout with what is missing."""
    import ray

    deadline = time.monotonic() + timeout_s
    problem = "could not connect"
    while time.monotonic() < deadline:
        try:
            if not ray.is_initialized():
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            nodes = ray.nodes()
            problem = check_nodes(nodes, expected, cpus_per_node, gpus_per_node, engine_nodes)
            if problem is None:
                return nodes
        except ConnectionError as e:
            problem = f"could not connect to {address}: {e}"
        time.sleep(poll_s)
    raise JoinTimeout(f"Ray cluster at {address} incomplete after {timeout_s:.0f} s: {problem}")


def _main(argv: list[str] | None = None) -> int:
    parser = SaoArgumentParser(prog="python -m megatron_sao.platform.ray_cluster")
    sub = parser.add_subparsers(dest="cmd", required=True)
    wait = sub.add_parser("wait", help="join barrier: wait for N nodes with the expected resources")
    wait.add_argument("--address", required=True)
    wait.add_argument("--nodes", type=int, required=True)
    wait.add_argument("--cpus-per-node", type=int, default=1)
    wait.add_argument("--gpus-per-node", type=int, default=0)
    wait.add_argument("--timeout", type=float, default=300.0)
    wait.add_argument("--engine-nodes", type=int, default=0, help=f"nodes that must offer {ENGINE_RESOURCE}")
    start = sub.add_parser("start", help="exec `ray start` (head or worker) in the foreground")
    start.add_argument("--head-address", default="", help="IP:PORT of the head; empty: start the head")
    start.add_argument("--ip", required=True)
    start.add_argument("--first-port", type=int, required=True)
    start.add_argument("--port-count", type=int, required=True)
    start.add_argument("--num-cpus", type=int, required=True)
    start.add_argument("--num-gpus", type=int, default=0)
    start.add_argument("--temp-dir", required=True)
    start.add_argument("--engine-node", action="store_true", help=f"offer the {ENGINE_RESOURCE} resource")
    args = parser.parse_args(argv)
    if args.cmd == "start":
        import os

        ports = PortBlock(args.first_port, args.port_count)
        spec = RayNodeSpec(args.num_cpus, args.num_gpus, args.temp_dir, worker_port_range(ports), args.engine_node)
        cmd = (worker_command(args.ip, args.head_address, ports, spec) if args.head_address
               else head_command(args.ip, ports, spec))
        beside = os.path.join(os.path.dirname(sys.executable), "ray")  # the venv's, when not on PATH
        cmd[0] = beside if os.path.exists(beside) else cmd[0]
        print("sao: " + " ".join(cmd), flush=True)
        os.execvp(cmd[0], cmd)
    try:
        nodes = wait_for_nodes(args.address, args.nodes, args.cpus_per_node, args.gpus_per_node, args.timeout,
                               engine_nodes=args.engine_nodes)
    except JoinTimeout as e:
        print(f"sao: {e}", file=sys.stderr, flush=True)
        return 3
    alive = [n for n in nodes if n.get("Alive")]
    print(f"sao: Ray cluster complete: {len(alive)} nodes " + ", ".join(sorted(n["NodeManagerAddress"] for n in alive))
          + (f" ({args.engine_nodes} engine nodes)" if args.engine_nodes else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
