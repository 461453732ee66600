"""`sao report RUN --compare OTHER`: runs overlaid, adaptation per phase of a shifting reward."""

from __future__ import annotations

import json

import pytest

from megatron_sao.cli import main
from megatron_sao.reporting.compare import phase_stats, write_comparison


def _run(path, rewards):
    path.mkdir(parents=True)
    with (path / "metrics.jsonl").open("w") as f:
        for step, reward in enumerate(rewards, 1):
            f.write(json.dumps({"step": step, "train/reward_mean": reward, "train/success_rate": reward / 2}) + "\n")
    return path


def test_phase_stats_measure_the_drop_and_the_recovery():
    # Two phases of 10 steps: phase 0 climbs to 1.0; the shift drops the reward to 0.2, it
    # recovers linearly to 1.0 by step 18.
    rewards = [0.1 * i for i in range(1, 11)] + [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0, 1.0, 1.0]
    stats = phase_stats(list(range(1, 21)), rewards, phase_steps=10, window=3, smooth=1)
    assert [s.start_step for s in stats] == [1, 11]
    assert stats[1].early == pytest.approx(0.3) and stats[1].late == pytest.approx(1.0)
    assert stats[1].recovery_steps == 7  # step 18 is the first at >= 0.9
    never = phase_stats([1, 2, 3], [0.0, 0.0, 0.0], phase_steps=3, window=1, smooth=1)
    assert never[0].recovery_steps == 0  # 90% of a zero level is reached at once


def test_comparison_page_and_cli(tmp_path):
    fast = _run(tmp_path / "critic", [0.9] * 5 + [0.3, 0.8, 0.9, 0.9, 0.9])
    slow = _run(tmp_path / "running_mean", [0.9] * 5 + [0.3, 0.4, 0.5, 0.6, 0.9])
    result = write_comparison({"critic": fast, "running_mean": slow}, tmp_path / "out", phase_steps=5, smooth=1)
    assert {p.name for p in result.figures} == {"compare_train_reward_mean.png", "compare_train_success_rate.png"}
    assert result.phases["critic"][1].recovery_steps < result.phases["running_mean"][1].recovery_steps
    page = result.page.read_text()
    assert "Adaptation per phase (5 steps each)" in page and "running_mean" in page
    with pytest.raises(ValueError, match="no such file"):
        write_comparison({"missing": tmp_path / "nowhere"}, tmp_path / "out2")
    assert main(["report", str(fast), "--compare", str(slow), "--phase-steps", "5"]) == 0
    assert (fast / "comparison" / "index.html").is_file()
