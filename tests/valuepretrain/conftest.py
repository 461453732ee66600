"""A corpus generated once per session by the real engines and agent loop (tiny model, CPU engine)."""

from __future__ import annotations

import pytest

from megatron_sao.config import load_config


def generate_config(tmp_path, corpus_dir, hf_dir, prompts, *overrides: str):
    return load_config(None, [
        f"run.output_dir={tmp_path}", "run.name=gen", f"model.hf_path={hf_dir}", "model.dtype=float32",
        f"data.train_path={prompts}", f"value_pretrain.corpus_dir={corpus_dir}", "value_pretrain.samples_per_prompt=2",
        "value_pretrain.prompts_per_shard=4", "value_pretrain.row_group_size=2", "value_pretrain.heldout_fraction=0.25",
        "rollout.engine=cpu", "rollout.environment=calc", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=24",
        "rollout.max_total_tokens=512", "rollout.max_inflight_per_engine=16", *overrides])


@pytest.fixture(scope="session")
def generated(tmp_path_factory):
    """(config, result) of `generate` over 16 calc prompts x 2 samples, with the tiny model tuned to
    end its turns now and then (so rewards are graded, not all zero)."""
    from megatron_sao.rollout.envs.calc import write_calc_dataset
    from megatron_sao.valuepretrain.generate import run_generate
    from tests.rollout.engine_helpers import stoppy_checkpoint

    root = tmp_path_factory.mktemp("generated")
    prompts = write_calc_dataset(root / "prompts.jsonl", 16, seed=0)
    config = generate_config(root, root / "corpus", stoppy_checkpoint(), prompts)
    return config, run_generate(config)
