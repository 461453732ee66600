"""SGLang engine placement and launch lines (platform/engine_nodes.py): engines packed onto nodes,
engines spanning nodes with one identical line per node but --node-rank, and the shapes refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sao.config import load_config
from megatron_sao.config.placement import gpu_layout
from megatron_sao.platform.engine_nodes import PORTS_PER_ENGINE, place_engines, sglang_node_commands

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_engines_smaller_than_a_node_are_packed_side_by_side() -> None:
    slots = place_engines(["e1", "e2"], gpus_per_node=8, num_engines=8, gpus_per_engine=2, first_port=24000)
    assert [(s.nodes, s.base_gpu) for s in slots[:5]] == [(("e1",), 0), (("e1",), 2), (("e1",), 4), (("e1",), 6),
                                                          (("e2",), 0)]
    assert len({s.port for s in slots}) == 8 and slots[1].port - slots[0].port == PORTS_PER_ENGINE
    (node, line), = sglang_node_commands(slots[5], "10.0.0.2", "/m", tensor=2)
    assert node == "e2" and "--nnodes" not in line and "--dist-init-addr" not in line
    assert line[line.index("--base-gpu-id") + 1] == "2" and line[line.index("--tp-size") + 1] == "2"


def test_an_engine_spanning_two_nodes_gets_one_line_per_node() -> None:
    nodes = [f"gpu{i:02d}" for i in range(4)]
    slots = place_engines(nodes, gpus_per_node=8, num_engines=2, gpus_per_engine=16, first_port=24000)
    assert [s.nodes for s in slots] == [("gpu00", "gpu01"), ("gpu02", "gpu03")]
    lines = sglang_node_commands(slots[1], "10.0.0.3", "/ckpt/dsv3", tensor=16, expert=16, data=16,
                                 mem_fraction_static=0.85, extra_args=("--trust-remote-code",))
    assert [node for node, _ in lines] == ["gpu02", "gpu03"]
    (_, rank0), (_, rank1) = lines
    differ = [(a, b) for a, b in zip(rank0, rank1, strict=True) if a != b]
    assert differ == [("0", "1")]  # only --node-rank
    assert rank0[rank0.index("--node-rank") - 1] == "2"  # --nnodes 2
    assert rank0[rank0.index("--dist-init-addr") + 1] == f"10.0.0.3:{slots[1].dist_port}"
    # DP attention as 0.5.23 spells it (--enable-dp-attention is deprecated): one replica, attention DP 16
    assert rank0[rank0.index("--attn-dp-size") + 1] == "16" and rank0[rank0.index("--dp-size") + 1] == "1"
    assert "--enable-dp-attention" not in rank0 and rank0[-1] == "--trust-remote-code"
    assert slots[1].dist_port not in {s.port for s in slots}


@pytest.mark.parametrize("nodes, per_node, engines, per_engine, message", [
    (["a"], 8, 1, 3, "does not divide a node"),
    (["a", "b"], 8, 1, 12, "whole nodes"),
    (["a", "b", "c"], 8, 2, 16, "need 4 nodes"),
    (["a"], 8, 5, 2, "need 2 nodes"),
])
def test_shapes_that_do_not_fit_are_refused(nodes: list[str], per_node: int, engines: int, per_engine: int,
                                            message: str) -> None:
    with pytest.raises(ValueError, match=message):
        place_engines(nodes, per_node, engines, per_engine, first_port=24000)


@pytest.mark.parametrize("recipe", ["deepseek_v3_671b_math_sao.yaml", "glm5_744b_a40b_swe_sao.yaml",
                                    "qwen3_235b_a22b_math_sao.yaml"])
def test_shipped_recipes_engines_fit_their_engine_nodes(recipe: str) -> None:
    config = load_config(str(RECIPES / recipe), [])
    layout = gpu_layout(config)
    names = [f"n{i}" for i in range(layout.engine_nodes)]
    slots = place_engines(names, config.launcher.nproc_per_node, config.rollout.num_engines,
                          config.rollout.sglang.tensor, first_port=24000)
    assert len(slots) == config.rollout.num_engines
    assert {n for s in slots for n in s.nodes} == set(names)  # every engine node used, none twice
