"""The compute device of a rank (platform/device.py): the rule over launchers, what
`init_distributed` makes of each launcher's environment (CUDA faked), and the environment a real
Ray 2.60 gives GPU rank actors."""

from __future__ import annotations

import os

import pytest
import torch

import megatron_sao.platform.device as device_module
from megatron_sao.platform.device import cuda_index_for_rank, visible_gpu_ids


@pytest.mark.parametrize(("case", "local_rank", "count", "assigned", "visible", "expected"), [
    ("ray: its one GPU visible", 1, 1, ["3"], ["3"], 0),
    ("ray NOSET: all GPUs visible", 1, 8, ["3"], None, 3),
    ("ray NOSET under a narrowed CUDA_VISIBLE_DEVICES", 0, 4, ["6"], ["4", "5", "6", "7"], 2),
    ("ray with GPU UUIDs", 0, 2, ["GPU-b"], ["GPU-a", "GPU-b"], 1),
    ("torchrun / spawn: the node's GPUs", 5, 8, [], None, 5),
    ("srun, all node GPUs visible: SLURM_LOCALID", 3, 8, [], ["0", "1", "2", "3", "4", "5", "6", "7"], 3),
    ("srun --gpus-per-task=1: the one bound GPU", 5, 1, [], ["5"], 0),
])
def test_rule(case, local_rank, count, assigned, visible, expected):
    assert cuda_index_for_rank(local_rank, count, assigned, visible) == expected, case


@pytest.mark.parametrize(("local_rank", "count", "assigned", "visible", "match"), [
    (5, 4, [], None, "LOCAL_RANK=5 but this process sees 4 CUDA devices"),
    (0, 2, ["3"], ["0", "1"], "assigned GPU 3 but CUDA_VISIBLE_DEVICES=0,1 does not list it"),
    (0, 2, ["3"], None, "assigned GPU 3 .* only 2 CUDA devices"),
    (0, 0, [], [], "no CUDA device is visible"),
])
def test_rule_refuses_what_cannot_agree(local_rank, count, assigned, visible, match):
    with pytest.raises(ValueError, match=match):
        cuda_index_for_rank(local_rank, count, assigned, visible)


def test_visible_gpu_ids():
    assert visible_gpu_ids({}) is None
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "3, 5"}) == ["3", "5"]
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}) == []


class _FakeCuda:
    """CUDA as a process sees it: `count` visible devices; `set_device` refuses others as the
    driver does ("invalid device ordinal")."""

    def __init__(self, count: int) -> None:
        self.count, self.current = count, None

    def set_device(self, index: int) -> None:
        if not 0 <= int(index) < self.count:
            raise RuntimeError("CUDA error: invalid device ordinal")
        self.current = int(index)


@pytest.fixture
def fake_cuda_rank(monkeypatch):
    """`init_distributed` as on a GPU node with the launcher's environment faked: CUDA present
    with `count` devices, the NCCL process group recorded instead of created."""
    import torch.distributed as dist

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(device_module, "_COMPUTE_DEVICE", None)
    groups = []

    def make(count: int, env: dict[str, str]) -> tuple[_FakeCuda, list[str]]:
        fake = _FakeCuda(count)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
        monkeypatch.setattr(dist, "is_initialized", lambda: bool(groups))
        monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: groups.append(backend))
        monkeypatch.setattr(dist, "get_rank", lambda *a, **k: int(os.environ["RANK"]))
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: int(os.environ["WORLD_SIZE"]))
        return fake, groups

    return make


RANK_ENV = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(("count", "env", "expected"), [
    (8, {"LOCAL_RANK": "1"}, 1),  # torchrun / spawn
    (1, {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "1"}, 0),  # srun binding one GPU per task
])
def test_init_distributed_sets_the_rule_s_device(fake_cuda_rank, count, env, expected):
    from megatron_sao.platform.distributed import init_distributed

    fake, groups = fake_cuda_rank(count, {**RANK_ENV, **env})
    init_distributed()
    assert fake.current == expected and groups == ["nccl"]
    assert device_module.compute_device() == torch.device("cuda", expected)


def test_ray_rank_actor_computes_on_the_gpu_ray_assigned(fake_cuda_rank, monkeypatch):
    """Rank 1 of a Ray job on one node: Ray gave its actor GPU 3 and CUDA_VISIBLE_DEVICES=3; the
    node index LOCAL_RANK=1 names no visible device (what `set_device(LOCAL_RANK)` tripped on)."""
    import ray

    from megatron_sao.platform.ray_ranks import _RankWorker

    fake, groups = fake_cuda_rank(1, {"CUDA_VISIBLE_DEVICES": "3"})
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3])
    env = {**RANK_ENV, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    for key, value in env.items():  # `run` exports them; monkeypatch restores them
        monkeypatch.setenv(key, value)
    assert _RankWorker().run(env, torch.get_num_threads(), device_module.compute_device, ()) == torch.device("cuda", 0)
    assert fake.current == 0 and groups == ["nccl"]


def _rank_view() -> dict[str, object]:
    import ray

    return {"local_rank": int(os.environ["LOCAL_RANK"]), "visible": visible_gpu_ids(),
            "assigned": [str(g) for g in ray.get_gpu_ids()]}


@pytest.mark.slow  # a local Ray instance and two actors: ~50 s on the 2-core VM
@pytest.mark.timeout(300)
def test_ray_gives_each_rank_actor_one_visible_gpu():
    """Real Ray 2.60 with two logical GPUs: each rank actor sees exactly the GPU it was assigned
    (CUDA_VISIBLE_DEVICES), so the rule picks device 0 for both ranks, not LOCAL_RANK."""
    import ray
    from ray.util.placement_group import placement_group

    from megatron_sao.platform.ray_ranks import RayRanks

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, configure_logging=False)
    try:
        group = placement_group([{"CPU": 1, "GPU": 1}] * 2, strategy="PACK")
        ray.get(group.ready(), timeout=120)
        ranks = RayRanks(2, group, [0, 1], num_cpus=1, num_gpus=1)
        try:
            views = ranks.run(_rank_view, timeout_s=240)
        finally:
            ranks.kill()
    finally:
        ray.shutdown()
    assert sorted(v["local_rank"] for v in views) == [0, 1]
    assert sorted(v["assigned"][0] for v in views) == ["0", "1"]
    for v in views:
        assert v["visible"] == v["assigned"]  # Ray narrowed CUDA_VISIBLE_DEVICES to the actor's GPU
        assert cuda_index_for_rank(v["local_rank"], len(v["visible"]), v["assigned"], v["visible"]) == 0
