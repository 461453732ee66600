"""Weight-sync defaults by placement and the SGLang layouts refused when the config loads: CUDA-IPC
tensors only reach engines on trainer rank 0's node and GPUs, NCCL cannot put trainer rank 0 and
the engine on its GPU in one communicator, engines on other nodes (or spanning nodes) need Ray,
and the distributed group's master is rank 0's node address, not loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sao.config import ConfigError
from megatron_sao.config.loader import load_config
from megatron_sao.config.placement import engine_placement, weight_sync_mode
from megatron_sao.config.schema import WeightSyncConfig
from megatron_sao.pipeline.weight_sync import WeightSync
from megatron_sao.rollout.settings import engine_config_from

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
QWEN = str(RECIPES / "qwen3_30b_a3b_math_sao.yaml")
ONE_NODE = ["launcher.nnodes=1", "parallelism.context=1", "rollout.sglang.tensor=2"]
COLOCATED = [*ONE_NODE, "parallelism.world_size=8", "parallelism.expert=8", "rollout.num_engines=4"]
DISAGGREGATED = [*ONE_NODE, "parallelism.world_size=4", "parallelism.expert=4", "rollout.num_engines=2"]


def test_auto_picks_tensor_when_colocated_and_distributed_when_not():
    colocated = load_config(QWEN, COLOCATED)  # launcher.engine_placement=auto, trainers on every GPU
    assert engine_placement(colocated) == "colocated" and weight_sync_mode(colocated) == "tensor"
    assert engine_config_from(colocated).enable_memory_saver  # release frees nothing without it
    recipe = load_config(QWEN, [])
    assert engine_placement(recipe) == "disaggregated" and weight_sync_mode(recipe) == "distributed"
    assert not engine_config_from(recipe).enable_memory_saver
    cpu = load_config(str(RECIPES / "tiny_cpu_engine.yaml"), [])
    assert weight_sync_mode(cpu) == "tensor"  # safetensors bytes over HTTP reach any node


@pytest.mark.parametrize(("overrides", "needles"), [
    ([*DISAGGREGATED, "rollout.weight_sync.mode=tensor"], ["rollout.weight_sync.mode=tensor", "disaggregated"]),
    ([*COLOCATED, "rollout.weight_sync.mode=distributed"], ["rollout.weight_sync.mode=distributed", "NCCL"]),
    ([*COLOCATED, "launcher.nnodes=2", "parallelism.world_size=16", "parallelism.expert=16",
      "rollout.num_engines=8", "rollout.weight_sync.mode=tensor"],
     ["launcher.nproc_per_node", "only processes on its node"]),
    (["launcher.ray=false"], ["launcher.ray", "rank 0's node"]),
    (["rollout.sglang.data=3"], ["rollout.sglang.data", "rollout.sglang.tensor"]),
])
def test_layouts_that_cannot_work_are_refused_naming_the_keys(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_config(QWEN, overrides)
    for needle in needles:
        assert needle in str(info.value)


def test_engines_spanning_nodes_need_ray():
    deepseek = str(RECIPES / "deepseek_v3_671b_math_sao.yaml")
    config = load_config(deepseek, [])  # TP 16 engines over two 8-GPU nodes, on Ray
    assert engine_config_from(config).attn_dp_size == 16 and engine_config_from(config).dp_size == 1
    with pytest.raises(ConfigError, match=r"rollout.sglang.tensor = 16 .*launcher.ray=true"):
        load_config(deepseek, ["launcher.ray=false"])


def test_engines_outside_ray_start_after_the_trainers_gpus():
    config = load_config(QWEN, [*DISAGGREGATED, "launcher.ray=false"])
    assert engine_config_from(config).base_gpu_id == 4


def test_the_group_master_is_rank_0s_node_address(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert WeightSync(exporter=None, config=WeightSyncConfig(mode="distributed")).master_address == "10.1.2.3"
    configured = WeightSyncConfig(mode="distributed", master_address="10.9.9.9")
    assert WeightSync(exporter=None, config=configured).master_address == "10.9.9.9"
    monkeypatch.delenv("MASTER_ADDR")
    assert WeightSync(exporter=None, config=WeightSyncConfig(mode="distributed")).master_address == "127.0.0.1"
