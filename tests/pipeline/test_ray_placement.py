"""Placement on Ray: the bundles a config asks for, and short `sao train` runs with the trainer
ranks, the engines and the rollout (agent loop, ready buffer) as Ray actors in one placement group,
colocated and disaggregated."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import psutil
import pytest
import torch

from megatron_sao.config import load_config
from megatron_sao.jobs.train import run_train
from megatron_sao.pipeline.placement import RayPlacement, ray_placement
from tests.pipeline.test_engine_faults import _identity_holds
from tests.pipeline.test_engine_training import _engine_config, _rows


def test_disaggregated_bundles_give_engines_devices_of_their_own():
    p = RayPlacement(placement="disaggregated", trainer_ranks=4, num_engines=2, devices_per_engine=2, use_gpus=True)
    assert p.bundle_count == 9 and p.bundles()[0] == {"CPU": 1.0, "GPU": 1.0}
    assert p.trainer_bundles() == [0, 1, 2, 3] and p.engine_bundles() == [4, 6]
    assert p.rollout_bundle() == 8 and p.bundles()[8] == {"CPU": 1.0}  # the rollout actor: CPU only
    assert p.trainer_resources() == (1.0, 1.0) and p.engine_resources() == (1.0, 1.0)


def test_colocated_bundles_share_devices_between_trainers_and_engines():
    p = RayPlacement(placement="colocated", trainer_ranks=4, num_engines=2, devices_per_engine=2, use_gpus=True)
    assert p.bundle_count == 5 and p.engine_bundles() == [0, 2] and p.rollout_bundle() == 4
    assert p.trainer_resources() == (0.5, 0.5) and p.engine_resources() == (0.5, 0.5)
    # Two CPU engines colocated with one trainer rank split the half the trainer leaves.
    cpu = RayPlacement(placement="colocated", trainer_ranks=1, num_engines=2, devices_per_engine=1, use_gpus=False)
    assert cpu.engine_bundles() == [0, 0] and cpu.engine_resources() == (0.25, 0.0)
    assert cpu.bundles() == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_placement_follows_the_config():
    sft = ray_placement(load_config(None, ["launcher.nproc_per_node=2", "rollout.engine=cpu"]), with_engines=False)
    assert (sft.trainer_ranks, sft.num_engines, sft.bundle_count) == (2, 0, 2)  # no engines, no rollout bundle
    # without engines a CPU box gets CPU bundles, whatever rollout.engine names (before: GPU bundles that
    # no CPU box can hold, for `sao sft` / `sao value-pretrain train` with launcher.ray)
    no_engines = ray_placement(load_config(None, ["launcher.nproc_per_node=2", "rollout.engine=sglang"]),
                               with_engines=False)
    assert no_engines.bundles() == [{"CPU": 1.0}] * 2 or torch.cuda.is_available()
    rl = ray_placement(load_config(None, ["launcher.nproc_per_node=2", "rollout.engine=cpu", "rollout.num_engines=3",
                                          "launcher.engine_placement=colocated"]), with_engines=True)
    assert rl.placement == "colocated" and rl.engine_bundles() == [0, 1, 0] and not rl.use_gpus
    # GPU engines: `auto` resolves as `sao plan` does (all GPUs to trainers -> colocated).
    gpu = ray_placement(load_config(None, ["launcher.nproc_per_node=8", "rollout.engine=sglang",
                                           "rollout.num_engines=2", "rollout.sglang.tensor=4"]), with_engines=True)
    assert gpu.placement == "colocated" and gpu.engine_bundles() == [0, 4] and gpu.use_gpus


def _processes(marker: str, start: bool = False) -> list[psutil.Process]:
    """This test's processes (a local Ray instance's actors descend from its driver; other runs on
    the machine do not count) whose command line holds `marker` (starts with it: `start`)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(p.cmdline())
            if cmdline.startswith(marker) if start else marker in cmdline:
                found.append(p)
    return found


def _engine_servers() -> list[psutil.Process]:
    return _processes("megatron_sao.cpu_engine")


def _engine_peers(processes: list[psutil.Process], engine_ports: set[int]) -> set[int]:
    """The pids among `processes` with a TCP connection to an engine server's port."""
    pids = set()
    for p in processes:
        with contextlib.suppress(psutil.Error):
            if any(c.raddr and c.raddr.port in engine_ports for c in p.net_connections(kind="tcp")):
                pids.add(p.pid)
    return pids


@pytest.mark.timeout(900)
@pytest.mark.parametrize("placement", ["disaggregated", pytest.param("colocated", marks=pytest.mark.slow)])
def test_short_run_on_ray(tmp_path, tiny_hf_dir, placement):
    seen: list[int] = []
    parents: set[str] = set()  # what started each engine server: a Ray engine host actor, not a trainer rank
    rollout_pids: set[int] = set()  # the rollout actor's process (agent loop, ready buffer)
    rank_pids: set[int] = set()  # the trainer ranks' processes
    talking: set[int] = set()  # processes seen with a connection to an engine server
    cfg = _engine_config(tmp_path, tiny_hf_dir, placement, "run.total_steps=2", "launcher.ray=true",
                         f"launcher.engine_placement={placement}")
    done = threading.Event()

    def watch() -> None:  # the engine servers run under Ray's actors, not under this process
        while not done.is_set():
            ports: set[int] = set()
            for server in _engine_servers():
                seen.append(server.pid)
                with contextlib.suppress(psutil.Error, AttributeError):
                    parents.add(" ".join(server.parent().cmdline()))
                    ports.update(c.laddr.port for c in server.net_connections(kind="tcp")
                                 if c.status == psutil.CONN_LISTEN)
            rollouts, ranks = _processes("ray::RolloutActor", start=True), _processes("ray::_RankWorker", start=True)
            rollout_pids.update(p.pid for p in rollouts)
            rank_pids.update(p.pid for p in ranks)
            talking.update(_engine_peers([*rollouts, *ranks, psutil.Process()], ports))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code, result, run_dir = run_train(cfg)
    done.set()
    watcher.join(timeout=5)
    assert code == 0 and result["step"] == 2
    rows = _rows(run_dir)
    _identity_holds(rows)
    assert rows[-1]["rollout/weight_version"] == 1  # step 1 is critic warmup, step 2 an actor update
    assert seen and parents and all(p.startswith("ray::_EngineHost") for p in parents), parents
    # The agent loop runs in a Ray actor of its own: neither the driver nor a trainer rank. Every
    # engine request (generation, and the weight push, forwarded through it) comes from there.
    assert len(rollout_pids) == 1 and rank_pids and not rollout_pids & (rank_pids | {os.getpid()})
    assert talking == rollout_pids, (talking, rollout_pids, rank_pids)
    assert not _engine_servers()  # stopped with the run


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["distributed", "disk"])
def test_weight_sync_modes_through_the_rollout_actor(tmp_path, tiny_hf_dir, mode):
    """The other two weight-sync paths across the rollout actor's boundary (tensor is the default,
    above): the process group from trainer rank 0 to the engines, and the HF directory on disk."""
    cfg = _engine_config(tmp_path, tiny_hf_dir, mode, "run.total_steps=2", "launcher.ray=true",
                         f"rollout.weight_sync.mode={mode}")
    code, result, run_dir = run_train(cfg)
    assert code == 0 and result["step"] == 2
    rows = _rows(run_dir)
    _identity_holds(rows)
    assert rows[-1]["rollout/weight_version"] == 1 and rows[-1]["rollout/weight_sync_failures"] == 0
    assert rows[-1]["weight_sync/bytes"] > 0
