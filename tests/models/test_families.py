"""Training builds every shipped model family straight from its HF checkpoint (megatron-bridge
load, CPU block spec) and reproduces the HF model's logits (fp32, max-abs <= 1e-5)."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.platform import run_distributed
from tests.models.families_worker import FAMILIES


@pytest.mark.timeout(600)
def test_every_family_builds_for_training_with_hf_logits(single_rank):
    diffs = single_rank["families"]  # computed in the `single_rank` process (tests/conftest.py)
    for family in FAMILIES:
        assert diffs[family] <= 1e-5, (family, diffs[family])


def _logits_under_cp(hf_dirs: dict[str, str]) -> dict[str, float]:
    """Each family built with context parallelism over all ranks: every rank runs its two chunks
    of the sequence, the gathered logits are compared with HF's."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from megatron_sao.config import load_config
    from megatron_sao.models import build_model
    from megatron_sao.models.outputs import position_ids_for
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.platform.context_parallel import cp_group, gather_sequence, split_sequence

    cp = dist.get_world_size()
    diffs = {}
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    for family, hf_dir in hf_dirs.items():
        cfg = load_config(None, [f"model.hf_path={hf_dir}", "model.dtype=float32", f"parallelism.world_size={cp}",
                                 f"parallelism.context={cp}", "logging.param_table=false"])
        init_model_parallel(cfg.parallelism)
        model = build_model(cfg, "actor").chunks[0].eval()
        local = split_sequence({"ids": ids, "positions": position_ids_for(ids)}, cp_group())
        with torch.no_grad():
            ours = gather_sequence(model(local["ids"], local["positions"], None), cp_group())
            theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids).logits
        diffs[family] = float((ours - theirs).abs().max())
    return diffs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_family_under_context_parallelism_matches_hf(tmp_path):
    """CP 2 on the CPU spec: standard GQA (Qwen3, GLM-4.5's partial rotary), MLA with YaRN
    (DeepSeek-V3) through `CausalAttention`, and GLM-5's DSA through Megatron's `DSAttention`."""
    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint

    dirs = {f: str(build_tiny_hf_checkpoint(tmp_path / f, family=f, seed=1)) for f in FAMILIES}
    for rank_diffs in run_distributed(_logits_under_cp, 2, dirs):
        for family in FAMILIES:
            assert rank_diffs[family] <= 1e-5, (family, rank_diffs[family])
