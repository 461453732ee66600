"""Forming a Ray cluster over a job's nodes: start lines, and a join barrier that fails fast.

Reported Ray-on-Slurm failures this answers: the driver starting before every worker joined
(`wait_for_nodes` blocks until N alive nodes with the expected CPUs / GPUs each, or exits
non-zero naming what is missing), wrong CPU counts (CPUs and GPUs are passed explicitly from
Slurm's allocation, never auto-detected from the whole machine), port collisions (every port
from the job's block, see platform/slurm.py).

`python -m megatron_sao.platform.ray_cluster wait --address IP:PORT --nodes N ...` is the
barrier the job script runs.

Authentication. Ray 2.60 decides per process whether to use token authentication, and the
deciding differs between its entry points (ray/_private/authentication/authentication_token_setup.py,
ray/scripts/scripts.py, ray/_private/worker.py): `ray start --head` turns it on when
`~/.ray/auth_token` exists, `ray start --address` and `ray.init(address=IP:PORT)` never do, and
a local `ray.init()` always does (writing `~/.ray/auth_token` if missing). So once that file
exists (the first local `ray.init()` creates it) the head demands a token its workers and the
join barrier do not send: `InvalidAuthToken`, after minutes of retries. The job scripts
therefore set the mode explicitly for every Ray process of a cluster, with a token of that
cluster's own (`cluster_auth_env`: `RAY_AUTH_MODE=token`, `RAY_AUTH_TOKEN`, which Ray's token
loader reads before any file), exported to every node through srun; `connect_ray` does the same
for a local instance. The cluster then starts and joins the same way whatever
`~/.ray/auth_token` holds, and a join that still fails says whether the cluster refused the
token or could not be reached (`join_failure`).
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass

from megatron_sao.platform.slurm import PortBlock
from megatron_sao.utils.args import SaoArgumentParser, float_in, int_at_least

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


class JoinRefused(RuntimeError):
    """The cluster refused this client's authentication token: retrying cannot help."""


AUTH_MODE = "RAY_AUTH_MODE"
AUTH_TOKEN = "RAY_AUTH_TOKEN"
"""Ray 2.60's variables: the authentication mode (`disabled` / `token`), and a token that wins
over `RAY_AUTH_TOKEN_PATH` and `~/.ray/auth_token` (ray/_private/authentication_test_utils.py
lists all three; the C++ loader reads them in that order)."""


def cluster_auth_env() -> dict[str, str]:
    """Token authentication with a fresh token (Ray's own format: 32 random bytes, hex) for one
    cluster; every process of the cluster (`ray start` on each node, the clients) gets both."""
    return {AUTH_MODE: "token", AUTH_TOKEN: secrets.token_hex(32)}


def use_explicit_auth() -> None:
    """Before this process starts a local Ray instance: unless the environment already says how
    to authenticate, token mode with a token of its own, so that neither the mode nor the token
    depends on `~/.ray/auth_token` (nor does the instance write one). Ray caches the mode and
    the token per process: both caches are refreshed, as Ray's own `_enable_token_auth` does."""
    if AUTH_MODE in os.environ:
        return
    os.environ.update(cluster_auth_env())
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _reachable(address: str, timeout_s: float = 3.0) -> str | None:
    """None when something accepts TCP connections at `address` (HOST:PORT), else why not."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except (OSError, ValueError) as e:
        return str(e) or type(e).__name__


def join_failure(address: str, error: BaseException) -> tuple[bool, str]:
    """(refused for authentication, why) for a failed `ray.init(address=...)`: the cluster refused
    the token (Ray's error chain names `InvalidAuthToken` / `AuthenticationError`), nothing answers
    at the address, or the GCS answered but the connection failed otherwise."""
    chain, cause = [], error
    while cause is not None and len(chain) < 8:
        chain.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    text = " | ".join(chain)
    mode = os.environ.get(AUTH_MODE, "unset")
    if "InvalidAuthToken" in text or "AuthenticationError" in text or "Unauthenticated" in text:
        return True, (f"authentication failed: the Ray cluster at {address} refused this client's token "
                      f"({AUTH_MODE}={mode}, {AUTH_TOKEN} {'set' if os.environ.get(AUTH_TOKEN) else 'not set'}); "
                      f"every process of a cluster needs the same {AUTH_MODE} and token (the job scripts export "
                      "both; see platform/ray_cluster.py)")
    unreachable = _reachable(address)
    if unreachable is not None:
        return False, f"unreachable: nothing answers at {address} ({unreachable}); the head is not up (yet) or the " \
                      "address / port is wrong"
    return False, f"could not connect to {address}: {chain[-1][:300] if chain else error}"


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
                # ray.init retries an address where nothing listens for minutes, past any deadline
                if (unreachable := _reachable(address)) is not None:
                    problem = (f"unreachable: nothing answers at {address} ({unreachable}); the head is not up (yet) "
                               "or the address / port is wrong")
                    time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
                    continue
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            nodes = ray.nodes()
            problem = check_nodes(nodes, expected, cpus_per_node, gpus_per_node, engine_nodes)
            if problem is None:
                return nodes
        except (ConnectionError, RuntimeError) as e:
            refused, problem = join_failure(address, e)
            if refused:
                raise JoinRefused(problem) from None
        time.sleep(poll_s)
    raise JoinTimeout(f"Ray cluster at {address} incomplete after {timeout_s:.0f} s: {problem}")


def _main(argv: list[str] | None = None) -> int:
    parser = SaoArgumentParser(prog="python -m megatron_sao.platform.ray_cluster")
    sub = parser.add_subparsers(dest="cmd", required=True)
    wait = sub.add_parser("wait", help="join barrier: wait for N nodes with the expected resources")
    wait.add_argument("--address", required=True)
    wait.add_argument("--nodes", type=int_at_least(1), required=True)
    wait.add_argument("--cpus-per-node", type=int_at_least(0), default=1)
    wait.add_argument("--gpus-per-node", type=int_at_least(0), default=0)
    wait.add_argument("--timeout", type=float_in(0.0, low_open=True), default=300.0)
    wait.add_argument("--engine-nodes", type=int_at_least(0), default=0,
                      help=f"nodes that must offer {ENGINE_RESOURCE}")
    sub.add_parser("token", help="print a fresh cluster token (RAY_AUTH_TOKEN for every process of one cluster)")
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
    if args.cmd == "token":
        print(cluster_auth_env()[AUTH_TOKEN])
        return 0
    if args.cmd == "start":
        if AUTH_MODE not in os.environ:  # Ray would decide from ~/.ray/auth_token, differently per node
            print(f"sao: {AUTH_MODE} is not set: every node of a cluster must use the same authentication "
                  f"(export {AUTH_MODE}=token and a shared {AUTH_TOKEN}, as the job scripts do)", file=sys.stderr)
            return 2
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
    except (JoinTimeout, JoinRefused) as e:
        print(f"sao: {e}", file=sys.stderr, flush=True)
        return 3
    alive = [n for n in nodes if n.get("Alive")]
    print(f"sao: Ray cluster complete: {len(alive)} nodes " + ", ".join(sorted(n["NodeManagerAddress"] for n in alive))
          + (f" ({args.engine_nodes} engine nodes)" if args.engine_nodes else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
