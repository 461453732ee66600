"""Where SGLang engines run in a job, and their launch lines, including engines spanning nodes.

The largest recipes (DeepSeek-V3, the GLM-5-class model) serve each engine with TP 16 over two
8-GPU nodes. SGLang runs such an engine as one `sglang.launch_server` per node, identical but
for `--node-rank`, meeting at `--dist-init-addr` (the first node's IP and a port of the job's
block); only node rank 0 serves HTTP. Engines of at most one node's GPUs are packed onto nodes
side by side (`--base-gpu-id`). This module computes that placement from the engine nodes of the
allocation and writes the per-node command lines (`sao launch slurm`'s engine component). The
pipeline starts multi-node engines on Ray (pipeline/ray_engines.py: one engine host per node of
an engine), each part an `EngineSupervisor` whose command line ends with `multi_node_args`.
"""

from __future__ import annotations

from dataclasses import dataclass

PORTS_PER_ENGINE = 8
"""Ports set aside per engine from the first one given: the HTTP port at +0 (SGLang derives a few
more of its own from it) and the multi-node rendezvous at +4."""


@dataclass(frozen=True, slots=True)
class EngineSlot:
    index: int
    nodes: tuple[str, ...]
    """Hostnames, node rank order; one for an engine that fits a node."""
    base_gpu: int
    """First GPU on its node (0 for engines spanning whole nodes)."""
    port: int
    """HTTP port, on nodes[0]."""
    dist_port: int
    """Rendezvous port of a multi-node engine, on nodes[0]."""


def place_engines(engine_nodes: list[str], gpus_per_node: int, num_engines: int, gpus_per_engine: int,
                  first_port: int) -> list[EngineSlot]:
    """Engines packed onto `engine_nodes`: several per node when they need fewer GPUs than a node
    has, whole consecutive nodes each when they need more. Each engine gets PORTS_PER_ENGINE ports
    counted from `first_port`. ValueError naming the numbers when the shapes do not divide or nodes run out."""
    if min(gpus_per_node, num_engines, gpus_per_engine) < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node}, num_engines={num_engines} and "
                         f"gpus_per_engine={gpus_per_engine} must all be >= 1")
    if gpus_per_engine <= gpus_per_node:
        if gpus_per_node % gpus_per_engine:
            raise ValueError(f"an engine of {gpus_per_engine} GPUs (rollout.sglang.tensor) does not divide a node "
                             f"of {gpus_per_node} GPUs")
        per_node = gpus_per_node // gpus_per_engine
        needed = -(-num_engines // per_node)
        layout = [((engine_nodes[i // per_node],), (i % per_node) * gpus_per_engine)
                  for i in range(min(num_engines, len(engine_nodes) * per_node))]
    else:
        if gpus_per_engine % gpus_per_node:
            raise ValueError(f"an engine of {gpus_per_engine} GPUs spanning nodes must use whole nodes of "
                             f"{gpus_per_node} GPUs")
        span = gpus_per_engine // gpus_per_node
        needed = num_engines * span
        layout = [(tuple(engine_nodes[i * span:(i + 1) * span]), 0) for i in range(len(engine_nodes) // span)]
    if len(engine_nodes) < needed:
        raise ValueError(f"{num_engines} engines of {gpus_per_engine} GPUs need {needed} nodes of {gpus_per_node} "
                         f"GPUs; the job has {len(engine_nodes)} engine nodes")
    return [EngineSlot(i, nodes, base, first_port + PORTS_PER_ENGINE * i, first_port + PORTS_PER_ENGINE * i + 4)
            for i, (nodes, base) in enumerate(layout[:num_engines])]


def multi_node_args(nnodes: int, node_rank: int, dist_init_addr: str) -> list[str]:
    """SGLang's flags for node `node_rank` of an engine spanning `nnodes` nodes, meeting at
    `dist_init_addr` (HOST:PORT on node rank 0; sglang 0.5.23 server_args `--nnodes`,
    `--node-rank`, `--dist-init-addr`)."""
    return ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]


def sglang_node_commands(slot: EngineSlot, head_ip: str, model_path: str, tensor: int, expert: int = 1,
                         data: int = 1, mem_fraction_static: float | None = None,
                         extra_args: tuple[str, ...] = (), python: str = "python") -> list[tuple[str, list[str]]]:
    """(hostname, command line) for every node of engine `slot`; `head_ip` is the advertised
    address of `slot.nodes[0]`."""
    common = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--tp-size", str(tensor),
              "--ep-size", str(expert), "--dp-size", "1", "--host", "0.0.0.0", "--port", str(slot.port),
              "--base-gpu-id", str(slot.base_gpu), "--skip-server-warmup"]
    if data > 1:  # DP attention: 0.5.23 deprecates --enable-dp-attention for --attn-dp-size (parallel_hook.py)
        common += ["--attn-dp-size", str(data)]
    if mem_fraction_static is not None:
        common += ["--mem-fraction-static", str(mem_fraction_static)]
    if len(slot.nodes) == 1:
        return [(slot.nodes[0], [*common, *extra_args])]
    return [(node, [*common, *multi_node_args(len(slot.nodes), rank, f"{head_ip}:{slot.dist_port}"), *extra_args])
            for rank, node in enumerate(slot.nodes)]
