"""The device-discipline test: a real SAO step with every batch tensor and collective input
checked against the compute device (tests/emulated_device.py)."""

from __future__ import annotations

import math

import pytest

from megatron_sao.platform import run_distributed
from tests.training import device_worker


def test_sao_step_keeps_every_tensor_on_the_compute_device(two_ranks):
    ranks = [r["device_discipline"] for r in two_ranks]  # run first in the pair (tests/conftest.py)
    for r in ranks:
        assert r["params"] > 0 and r["params_not_on_device"] == []
        assert r["collectives"] > 0
        m = r["metrics"]
        assert m["critic/optimizer_steps"] == 2 and math.isfinite(m["actor/loss"]) and m["actor/grad_norm"] > 0


@pytest.mark.slow  # three more trainers on 2 ranks
def test_other_modes_keep_every_tensor_on_the_compute_device(tiny_hf_dir, tmp_path):
    r = run_distributed(device_worker.other_modes_on_emulated_device, 2, str(tiny_hf_dir), str(tmp_path))[0]
    assert math.isfinite(r["grpo_ppo"]["actor/loss"]) and r["grpo_ppo"]["actor/clip_frac"] >= 0.0
    assert math.isfinite(r["sft"]["actor/loss"]) and math.isfinite(r["critic"]["critic/value_loss"])
    assert r["heldout_tokens"] > 0 and r["loaded_step"] == 1 and r["collectives"] > 0
