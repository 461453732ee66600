"""`tools/simulate_async.py`: the discrete-event model's invariants (accounting, bounds, the exact
timing of a barrier round, and async = sync when there is nothing to overlap or to wait for)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "simulate_async.py"


def _tool():
    spec = importlib.util.spec_from_file_location("simulate_async", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulate_async"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


sim = _tool()
LONG_TAIL = sim.Lengths(median=20, sigma=1.2, max_tokens=400, gen_frac=0.5)


def _check_accounting(r) -> None:
    c = r.counts
    assert c["started"] == c["completed"] + c["in_flight"], c
    assert c["completed"] == c["trained"] + c.get("dropped", 0) + c["buffered"], c
    for frac in (r.trainer_idle_frac, r.engine_idle_frac, r.occupancy, r.dropped_frac):
        assert -1e-9 <= frac <= 1 + 1e-9, r


@pytest.mark.parametrize("barrier", [False, True])
@pytest.mark.parametrize("check", ["token", "trajectory"])
def test_every_trajectory_is_accounted_for_and_fractions_are_fractions(barrier: bool, check: str) -> None:
    sc = sim.Scenario(barrier=barrier, batch=8, engines=3, max_staleness=1, staleness_check=check, steps=30,
                      warmup_steps=3, seed=1)
    r = sim.simulate(sc, LONG_TAIL, sim.EngineCost(base_s=0.02, per_seq_s=0.005, max_inflight=4),
                     sim.TrainCost(fixed_s=0.1, per_token_s=0.002, sync_s=0.05))
    _check_accounting(r)
    assert r.trained_per_s > 0
    if barrier:  # a round starts from the current weights and nothing generates meanwhile
        assert r.staleness_p50 == r.staleness_p99 == 0
        assert r.counts.get("dropped", 0) == 0
    else:
        assert r.staleness_p99 <= 1  # what exceeds the bound is dropped, never trained


def test_a_barrier_round_takes_the_generation_plus_the_step_plus_the_sync() -> None:
    lengths = sim.Lengths(median=10, sigma=0.0, max_tokens=10)  # every trajectory: 10 tokens
    engine = sim.EngineCost(base_s=0.5, per_seq_s=1.0, max_inflight=8)
    train = sim.TrainCost(fixed_s=1.0, per_token_s=0.1, sync_s=2.0)
    r = sim.simulate(sim.Scenario(barrier=True, batch=8, engines=2, steps=5, warmup_steps=1), lengths, engine, train)
    generation = 10 * (0.5 + 1.0 * 4)  # 4 per engine, 10 decode steps
    step = 1.0 + 0.1 * 8 * 10 + 2.0
    assert r.trained_per_s == pytest.approx(8 / (generation + step), rel=1e-9)
    assert r.trainer_idle_frac == pytest.approx(generation / (generation + step), rel=1e-9)
    assert r.engine_idle_frac == pytest.approx(step / (generation + step), rel=1e-9)


def test_without_variance_or_training_cost_async_and_sync_agree() -> None:
    lengths = sim.Lengths(median=10, sigma=0.0, max_tokens=10)
    engine = sim.EngineCost(base_s=0.0, per_seq_s=1.0, max_inflight=8)
    free = sim.TrainCost(fixed_s=0.0, per_token_s=0.0, sync_s=0.0)
    rates = [sim.simulate(sim.Scenario(barrier=b, batch=8, engines=2, steps=40, warmup_steps=4), lengths, engine,
                          free).trained_per_s for b in (False, True)]
    assert rates[0] == pytest.approx(rates[1], rel=0.02)


def test_async_at_the_ideal_split_matches_colocated_sync_without_a_tail() -> None:
    """Linear costs, no variance, no sync cost: 4 GPU units time-shared (sync: all generate, then
    all train) give what 2 + 2 units give when both halves run at once (async), with a batch in
    flight either way."""
    lengths = sim.Lengths(median=10, sigma=0.0, max_tokens=10)
    engine = sim.EngineCost(base_s=0.0, per_seq_s=1.0, max_inflight=4)

    def train(units: int):
        return sim.TrainCost(fixed_s=0.0, per_token_s=1.0 / units, sync_s=0.0)

    colocated = sim.simulate(sim.Scenario(barrier=True, batch=8, engines=4, steps=40, warmup_steps=4), lengths,
                             engine, train(4))
    split = sim.simulate(sim.Scenario(barrier=False, batch=8, engines=2, max_staleness=1000, steps=40,
                                      warmup_steps=4), lengths, engine, train(2))
    assert colocated.trained_per_s == pytest.approx(8 / 40)  # 20 s generating + 20 s training
    assert split.trained_per_s == pytest.approx(colocated.trained_per_s, rel=0.05)


def test_same_seed_same_result_and_bad_scenarios_are_refused() -> None:
    sc = sim.Scenario(barrier=False, batch=4, engines=2, steps=10, warmup_steps=1, seed=3)
    engine = sim.EngineCost(base_s=0.01, per_seq_s=0.01, max_inflight=4)
    train = sim.TrainCost(fixed_s=0.0, per_token_s=0.001, sync_s=0.0)
    assert sim.simulate(sc, LONG_TAIL, engine, train) == sim.simulate(sc, LONG_TAIL, engine, train)
    with pytest.raises(ValueError, match="staleness_check"):
        sim.simulate(sim.Scenario(barrier=False, batch=4, engines=1, staleness_check="oldest"), LONG_TAIL, engine,
                     train)


def test_training_flops_follow_the_planner_count() -> None:
    params = {"actor_params": 1.0, "critic_params": 1.0, "active_params": 10.0, "critic_active": 5.0}
    # SAO: actor 4 passes (full recompute) + critic value forward + K=2 updates of 4 passes.
    assert sim.train_flops_per_token(params, critic=True) == 2 * 10 * 4 + 2 * 5 * (1 + 4 * 2)
    assert sim.train_flops_per_token(params, critic=False) == 2 * 10 * 5  # + old log-prob forward
    assert sim.min_trainer_gpus(params | {"actor_params": 100e9}, False, gpu_gb=100, usable=0.9, per_node=8) == \
        8 * math.ceil(math.ceil(18 * 100e9 / 90e9) / 8)


def _bench_json(path: Path) -> Path:
    """A minimal `bench_async.py --json` file: two modes, measured lengths and costs."""
    trajs = [{"staleness": s % 2, "turns": 2, "action_tokens": 10 + 5 * s, "tokens": 40 + 10 * s, "status": "completed"}
             for s in range(8)]
    steps = [{"wait_s": 1.0, "train_s": 0.5, "sync_s": 0.1, "tokens": 400, "action_tokens": 100}] * 2
    engine = {"idle_frac": 0.2, "decode_points": [[1, 0.011], [4, 0.014], [8, 0.018]]}
    result = {"trained_per_s": 2.0, "trainer_idle_frac": 0.5, "staleness_p99": 1, "steps": steps,
              "trajectories": trajs, "engine": engine}
    path.write_text(json.dumps({"args": {"inflight": 8, "batch": 4, "max_staleness": 4},
                                "results": {"sao": result, "sync_single": result}}))
    return path


def test_bench_costs_are_read_back(tmp_path: Path) -> None:
    data = json.loads(_bench_json(tmp_path / "bench.json").read_text())
    lengths, engine, train = sim.bench_models(data)
    assert engine["sao"].base_s == pytest.approx(0.01, abs=2e-3)
    assert engine["sao"].per_seq_s == pytest.approx(0.001, abs=2e-4)
    assert lengths.gen_frac == pytest.approx(sum(10 + 5 * s for s in range(8)) / sum(40 + 10 * s for s in range(8)))
    assert train["sao"].per_token_s == pytest.approx(0.5 / 400) and train["sao"].sync_s == pytest.approx(0.1)


@pytest.mark.timeout(120)
def test_cli_replays_a_bench_file_and_sweeps_a_small_deployment(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(TOOL), "--from-bench", str(_bench_json(tmp_path / "b.json")),
                          "--steps", "10", "--warmup-steps", "1"], capture_output=True, text=True, check=True).stdout
    assert "sao" in out and "sync_single" in out
    out = subprocess.run([sys.executable, str(TOOL), "--from-bench", str(tmp_path / "b.json"), "--steps", "10",
                          "--replay-engine", "sync_single"], capture_output=True, text=True, check=True).stdout
    assert out.count("10.0 + 1.00 x n ms") == 2  # both modes replayed with sync_single's engine fit
    out = subprocess.run([sys.executable, str(TOOL), "--gpus", "64", "--steps", "6", "--warmup-steps", "1",
                          "--len-median", "500", "--len-max", "4000"], capture_output=True, text=True,
                         check=True).stdout
    assert "best split for async SAO" in out or "(mem)" in out
    assert "colocated sync GRPO" in out
