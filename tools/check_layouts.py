"""Print how far each parallel layout's actor logits, critic values and grad norms are from the
single-process result on the tiny MoE (the numbers tests/models/test_layouts.py bounds by 1e-5).

    .venv/bin/python tools/check_layouts.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = {"tp2_sp": ["parallelism.tensor=2"], "ep2": ["parallelism.expert=2"], "pp2": ["parallelism.pipeline=2"]}


def main() -> None:
    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint
    from megatron_sao.platform import run_distributed
    from tests.models.layout_worker import run_layout

    with tempfile.TemporaryDirectory() as tmp:
        hf = str(build_tiny_hf_checkpoint(tmp, seed=0))
        single = run_distributed(run_layout, 1, hf, [])[0]
        header = ("layout", "rank", "logits max|d|", "values max|d|", "actor gn rel", "critic gn rel")
        print(f"{header[0]:<8}{header[1]:>5}{header[2]:>15}{header[3]:>15}{header[4]:>14}{header[5]:>15}")
        for name, overrides in LAYOUTS.items():
            for rank, res in enumerate(run_distributed(run_layout, 2, hf, overrides)):
                logits = (res["logits"] - single["logits"]).abs().max().item()
                values = (res["values"] - single["values"]).abs().max().item()
                actor = abs(res["actor"]["grad_norm"] / single["actor"]["grad_norm"] - 1)
                critic = abs(res["critic"]["grad_norm"] / single["critic"]["grad_norm"] - 1)
                print(f"{name:<8}{rank:>5}{logits:>15.2e}{values:>15.2e}{actor:>14.1e}{critic:>15.1e}")


if __name__ == "__main__":
    main()
