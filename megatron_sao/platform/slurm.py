"""Inside a Slurm job: node names, the IP each node advertises, per-job port ranges, and a task's
rank from Slurm's variables (`adopt_slurm_env`).

The failures users of Ray-on-Slurm stacks keep reporting start here: the head advertising the
wrong interface (a docker bridge, an IPoIB name that does not resolve), and two jobs sharing a
node picking the same Ray / master ports. So: node names come from Slurm's own hostlist syntax,
the IP from a named interface when one is given (else the hostname's first non-loopback
address), always logged; ports come from a configurable range, one block per job id.

Also a small command-line face used by the job script (sao_job.sbatch.in) (`python -m megatron_sao.platform.slurm
node-ip|ports|hostnames`), so the job script needs no parsing of its own.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import sys
from dataclasses import dataclass

from megatron_sao.utils.args import SaoArgumentParser

PORTS_PER_JOB = 16
"""Ports one job takes from its block (Ray GCS, dashboard, client, node/object managers, the
torch.distributed master, engine rendezvous, ...)."""


def adopt_slurm_env() -> bool:
    """Under an srun task without torchrun's variables, set RANK / WORLD_SIZE / LOCAL_RANK /
    LOCAL_WORLD_SIZE from Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
    SLURM_NTASKS_PER_NODE). True when this process is one rank of several.

    The one rule for every caller (the rank steps of `platform/srun.py`, conversions under srun in
    `platform/run_collective.py`): torchrun's RANK wins and is left as it is; a single task (or no
    Slurm) is left alone; several tasks need MASTER_ADDR and MASTER_PORT exported (ValueError
    otherwise): every task must reach the same rendezvous, and no fixed default port is taken,
    since jobs sharing a node would collide on it (`job_port_block` gives each job its own)."""
    if "RANK" in os.environ:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    if "SLURM_PROCID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return False
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError("running as one of several srun tasks but MASTER_ADDR / MASTER_PORT are not set: export "
                         "the first node's address and a free port (the job script of `sao launch slurm` does; "
                         "docs/conversion.md#multi-process), or launch with torchrun")
    local_size = os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]  # '4(x2)': 4 tasks on each of 2 nodes
    os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                      LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"), LOCAL_WORLD_SIZE=local_size)
    return True


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed hostlist ('gpu[01-03,07],login1') as names, in order."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            names.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                names.append(f"{prefix}{str(n).zfill(len(lo))}{suffix}")
    return names


@dataclass(frozen=True, slots=True)
class PortBlock:
    first: int
    count: int

    def port(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise ValueError(f"port index {index} outside this job's block of {self.count}")
        return self.first + index


def job_port_block(job_id: int, port_range: tuple[int, int], count: int = PORTS_PER_JOB) -> PortBlock:
    """The block of `count` ports job `job_id` uses inside `port_range` (inclusive): distinct for
    jobs whose ids differ by less than the number of blocks the range holds."""
    lo, hi = port_range
    blocks = (hi - lo + 1) // count
    if lo < 1024 or hi > 65535 or blocks < 1:
        raise ValueError(f"port range {lo}-{hi} must lie in 1024-65535 and hold at least {count} ports")
    return PortBlock(lo + (job_id % blocks) * count, count)


def parse_port_range(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if not match or int(match[1]) > int(match[2]):
        raise ValueError(f"port range must look like 20000-29999, got {text!r}")
    return int(match[1]), int(match[2])


def interface_ip(interface: str) -> str:
    """The IPv4 address of network interface `interface` (ValueError naming the ones there are)."""
    import psutil

    addrs = psutil.net_if_addrs()
    if interface not in addrs:
        raise ValueError(f"no network interface {interface!r} on {socket.gethostname()}; have: {', '.join(addrs)}")
    for addr in addrs[interface]:
        if addr.family == socket.AF_INET:
            return addr.address
    raise ValueError(f"interface {interface!r} on {socket.gethostname()} has no IPv4 address")


def node_ip(interface: str = "", hostname: str | None = None, allow_loopback: bool = False) -> str:
    """The address this node advertises: `interface`'s if named, else the first non-loopback
    IPv4 address `hostname` resolves to (loopback only when allowed: single-host test clusters)."""
    if interface:
        return interface_ip(interface)
    host = hostname or socket.gethostname()
    candidates = [str(info[4][0]) for info in socket.getaddrinfo(host, None, socket.AF_INET)]
    for ip in candidates:
        if not ipaddress.ip_address(ip).is_loopback:
            return ip
    if candidates and allow_loopback:
        return candidates[0]
    raise ValueError(f"{host} resolves only to loopback addresses {candidates}; name the interface to "
                     "advertise (launcher network interface, e.g. ib0 or eth0)")


def _main(argv: list[str] | None = None) -> int:
    parser = SaoArgumentParser(prog="python -m megatron_sao.platform.slurm")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ip = sub.add_parser("node-ip", help="print the IPv4 address this node advertises")
    ip.add_argument("--interface", default="")
    ip.add_argument("--allow-loopback", action="store_true")
    ports = sub.add_parser("ports", help="print this job's first port and count")
    ports.add_argument("--job-id", type=int, required=True)
    ports.add_argument("--range", default="20000-29999")
    hosts = sub.add_parser("hostnames", help="expand a Slurm hostlist, one name per line")
    hosts.add_argument("hostlist")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "node-ip":
            print(node_ip(args.interface, allow_loopback=args.allow_loopback))
        elif args.cmd == "ports":
            block = job_port_block(args.job_id, parse_port_range(args.range))
            print(block.first, block.count)
        else:
            print("\n".join(expand_hostlist(args.hostlist)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main())
