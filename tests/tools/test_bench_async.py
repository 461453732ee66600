"""`tools/bench_async.py`: the stop-tuned checkpoint, the engine-sample summary, and (slow) a tiny
end-to-end run of two modes whose JSON the simulator replays."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_async.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_async", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _tool()


@pytest.mark.timeout(300)
def test_the_checkpoint_stops_with_the_requested_probability(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bench.stop_tuned_checkpoint(tmp_path / "hf", stop_prob=0.2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "episode 3: act until told to stop"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False) + list(range(40, 120))])
    with torch.no_grad():
        p_stop = model(ids).logits.softmax(-1)[0, :, tokenizer.eos_token_id]
    assert p_stop.mean().item() == pytest.approx(0.2, abs=0.05)  # calibrated on random contexts
    assert p_stop.min().item() > 0.05  # every position can end a turn: no turn runs forever


def test_engine_summary_counts_idle_samples_and_decode_steps() -> None:
    samples = [{"t": 0.1 * i, "engine": 0, "paused": i == 3, "running": [0, 2, 4, 4, 4, 0][i], "waiting": 0,
                "steps": [0, 0, 10, 20, 20, 25][i], "tokens": [0, 0, 30, 70, 70, 90][i]} for i in range(6)]
    out = bench.engine_summary(samples, start=0.0, end=0.5, inflight=8)
    assert out["idle_frac"] == pytest.approx(3 / 6)  # empty at 0 and 5, paused at 3
    assert out["occupancy"] == pytest.approx((2 + 4 + 4 + 4) / 6 / 8)
    assert out["tokens_per_s"] == pytest.approx(90 / 0.5)
    # Only 1 -> 2 is a decode interval: 2 -> 3 and 3 -> 4 touch the pause, 4 -> 5 the empty engine.
    assert out["decode_points"] == [pytest.approx((3.0, 0.01))]


def test_percentile_is_a_value_of_the_list() -> None:
    assert bench.percentile([3, 1, 2, 10], 0.5) == 2
    assert bench.percentile(list(range(100)), 0.99) == 98
    assert bench.percentile([5], 0.99) == 5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_modes_run_end_to_end_and_replay(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(TOOL), "--modes", "sao,sync_grpo", "--steps", "2", "--batch", "4",
                          "--group", "2", "--inflight", "4", "--turns-median", "2", "--max-turns", "8",
                          "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "sao vs sync_grpo" in run.stdout
    results = json.loads(out.read_text())["results"]
    for mode, r in results.items():
        assert len(r["trajectories"]) == 2 * 4, mode
        assert 0 <= r["trainer_idle_frac"] <= 1 and 0 <= r["engine"]["idle_frac"] <= 1
        assert all(t["status"] in ("completed", "truncated") for t in r["trajectories"])
    assert results["sync_grpo"]["staleness_p99"] == 0  # the barrier: every batch from the current weights
    assert max(t["staleness"] for t in results["sao"]["trajectories"]) <= 4
    replay = subprocess.run([sys.executable, str(ROOT / "tools" / "simulate_async.py"), "--from-bench", str(out),
                             "--steps", "5", "--warmup-steps", "1"], capture_output=True, text=True, check=True)
    assert "sync_grpo" in replay.stdout
