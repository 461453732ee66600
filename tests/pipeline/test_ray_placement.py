"""Placement on Ray: the bundles a config asks for, and short `sao train` runs with the trainer
ranks and the engines as Ray actors in one placement group, colocated and disaggregated."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

from megatron_sao.config import load_config
from megatron_sao.jobs.train import run_train
from megatron_sao.pipeline.placement import RayPlacement, ray_placement
from tests.pipeline.test_engine_faults import _identity_holds
from tests.pipeline.test_engine_training import _engine_config, _rows


def test_disaggregated_bundles_give_engines_devices_of_their_own():
    p = RayPlacement(placement="disaggregated", trainer_ranks=4, num_engines=2, devices_per_engine=2, use_gpus=True)
    assert p.bundle_count == 8 and p.bundles()[0] == {"CPU": 1.0, "GPU": 1.0}
    assert p.trainer_bundles() == [0, 1, 2, 3] and p.engine_bundles() == [4, 6]
    assert p.trainer_resources() == (1.0, 1.0) and p.engine_resources() == (1.0, 1.0)


def test_colocated_bundles_share_devices_between_trainers_and_engines():
    p = RayPlacement(placement="colocated", trainer_ranks=4, num_engines=2, devices_per_engine=2, use_gpus=True)
    assert p.bundle_count == 4 and p.engine_bundles() == [0, 2]
    assert p.trainer_resources() == (0.5, 0.5) and p.engine_resources() == (0.5, 0.5)
    # Two CPU engines colocated with one trainer rank split the half the trainer leaves.
    cpu = RayPlacement(placement="colocated", trainer_ranks=1, num_engines=2, devices_per_engine=1, use_gpus=False)
    assert cpu.engine_bundles() == [0, 0] and cpu.engine_resources() == (0.25, 0.0)
    assert cpu.bundles() == [{"CPU": 1.0}]


def test_placement_follows_the_config():
    sft = ray_placement(load_config(None, ["launcher.nproc_per_node=2", "rollout.engine=cpu"]), with_engines=False)
    assert (sft.trainer_ranks, sft.num_engines, sft.bundle_count) == (2, 0, 2)
    rl = ray_placement(load_config(None, ["launcher.nproc_per_node=2", "rollout.engine=cpu", "rollout.num_engines=3",
                                          "launcher.engine_placement=colocated"]), with_engines=True)
    assert rl.placement == "colocated" and rl.engine_bundles() == [0, 1, 0] and not rl.use_gpus
    # GPU engines: `auto` resolves as `sao plan` does (all GPUs to trainers -> colocated).
    gpu = ray_placement(load_config(None, ["launcher.nproc_per_node=8", "rollout.engine=sglang",
                                           "rollout.num_engines=2", "rollout.sglang.tensor=4"]), with_engines=True)
    assert gpu.placement == "colocated" and gpu.engine_bundles() == [0, 4] and gpu.use_gpus


def _engine_servers() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if "megatron_sao.rollout.cpu_engine" in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


@pytest.mark.timeout(900)
@pytest.mark.parametrize("placement", ["disaggregated", pytest.param("colocated", marks=pytest.mark.slow)])
def test_short_run_on_ray(tmp_path, tiny_hf_dir, placement):
    own = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    seen: list[int] = []
    cfg = _engine_config(tmp_path, tiny_hf_dir, placement, "run.total_steps=2", "launcher.ray=true",
                         f"launcher.engine_placement={placement}")
    done = threading.Event()

    def watch() -> None:  # the engine servers run under Ray's actors, not under this process
        while not done.is_set():
            seen.extend(p.pid for p in _engine_servers())
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
    assert seen and not set(seen) & own
    assert not _engine_servers()  # stopped with the run
