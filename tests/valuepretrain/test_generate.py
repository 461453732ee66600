"""`sao value-pretrain generate`: the CPU engine and the agent loop write a sharded corpus with a
manifest; a rerun skips complete shards and rewrites an interrupted one."""

from __future__ import annotations

import shutil

import pytest

from megatron_sao.rollout.datasets import LoadReport
from megatron_sao.rollout.trajectory import TrajectoryStatus
from megatron_sao.utils.atomic import temporary_sibling
from megatron_sao.valuepretrain.check import check_shards
from megatron_sao.valuepretrain.corpus import is_heldout, read_manifest, write_manifest
from megatron_sao.valuepretrain.generate import run_generate
from megatron_sao.valuepretrain.stream import read_split
from tests.valuepretrain.conftest import generate_config


def test_generate_writes_every_shard_with_its_manifest(generated):
    config, result = generated
    corpus_dir = result.corpus_dir
    assert not result.stopped and result.shards_skipped == 0
    manifest = read_manifest(corpus_dir)
    assert result.shards_written == len(manifest.shards) >= 3
    assert {s.split for s in manifest.shards} == {"train", "heldout"}
    assert check_shards(corpus_dir, manifest.shards, verify_hash=True) == []
    written = sum(s.num_rows for s in manifest.shards)
    dropped = sum(n for s in manifest.shards for n in s.dropped.values())
    assert written + dropped == 16 * 2 and written >= 24
    assert manifest.generation["samples_per_prompt"] == 2 and manifest.totals()["train"]["tokens"] > 0
    for split in ("train", "heldout"):
        report = LoadReport()
        trajs = read_split(corpus_dir, manifest.split(split), 1000, report)
        assert report.num_skipped == 0 and len(trajs) == sum(s.num_rows for s in manifest.split(split))
        assert all(is_heldout(t.prompt_id, config.run.seed, 0.25) == (split == "heldout") for t in trajs)
        assert all(t.status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED) for t in trajs)
        assert all(t.num_action_tokens and all(lp < 0 for lp, m in zip(t.rollout_logprobs, t.loss_mask, strict=True)
                                                if m) for t in trajs)
        rewards = {round(t.total_reward, 4) for t in trajs}
        assert split == "heldout" or len(rewards) >= 3  # graded rewards, not all equal


def test_rerun_skips_complete_shards_and_rewrites_the_interrupted_one(generated, tmp_path):
    config, result = generated
    corpus_dir = tmp_path / "corpus"
    shutil.copytree(result.corpus_dir, corpus_dir, ignore=shutil.ignore_patterns("engine_logs"))
    manifest = read_manifest(corpus_dir)
    victim = manifest.shards.pop()  # interrupted before the manifest named it ...
    temporary_sibling(corpus_dir / victim.name).write_bytes(b"half a shard")  # ... or before the rename
    (corpus_dir / f"{victim.name}.tmp").write_bytes(b"half a shard")  # (what versions before utils.atomic left)
    write_manifest(corpus_dir, manifest)
    kept = {s.name: s.sha256 for s in manifest.shards}
    rerun = generate_config(tmp_path, corpus_dir, config.model.hf_path, config.data.train_path)
    again = run_generate(rerun)
    assert (again.shards_written, again.shards_skipped) == (1, len(kept))
    final = read_manifest(corpus_dir)
    assert {s.name: s.sha256 for s in final.shards if s.name in kept} == kept  # untouched
    assert final.shard(victim.name) is not None and not list(corpus_dir.glob("*.tmp"))
    assert check_shards(corpus_dir, final.shards, verify_hash=True) == []
    changed = generate_config(tmp_path, corpus_dir, config.model.hf_path, config.data.train_path,
                              "value_pretrain.samples_per_prompt=3")
    with pytest.raises(ValueError, match="samples_per_prompt"):
        run_generate(changed)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_gateway_scaffold_environment_generates_through_its_runner(tmp_path):
    """`rollout.environment=openai_scaffold`: every episode runs the scaffold against the gateway
    (`ScaffoldRunner`, picked by `rollout/serving.py`) and lands in the corpus with the verifier's
    reward. Before the shared composition, generation built an `AgentLoop` whose `reset` of a
    scaffold environment raised TypeError: every episode FAILED, no row written."""
    from megatron_sao.rollout.envs.calc import write_calc_dataset
    from tests.rollout.engine_helpers import tiny_checkpoint
    from tests.rollout.gateway.helpers import one_call_scaffold_overrides

    prompts = write_calc_dataset(tmp_path / "prompts.jsonl", 4, seed=0)
    config = generate_config(tmp_path, tmp_path / "corpus", tiny_checkpoint(), prompts,
                             "value_pretrain.samples_per_prompt=1", "value_pretrain.prompts_per_shard=2",
                             "value_pretrain.heldout_fraction=0.0", *one_call_scaffold_overrides(tmp_path))
    result = run_generate(config)
    manifest = read_manifest(result.corpus_dir)
    assert not result.stopped and result.shards_written == len(manifest.shards) == 2
    assert [s.dropped for s in manifest.shards] == [{}, {}]  # no episode failed
    trajs = read_split(result.corpus_dir, manifest.split("train"), 1000, LoadReport())
    assert sorted(t.prompt_id for t in trajs) == sorted(s.prompt_id for s in _calc_prompts(prompts))
    for traj in trajs:
        assert traj.status == TrajectoryStatus.COMPLETED and traj.terminal_reward == 1.0
        assert traj.num_action_tokens > 0 and traj.metadata["scaffold"]["exit_code"] == 0


def _calc_prompts(path):
    from megatron_sao.rollout.datasets import load_prompts

    return load_prompts(path).samples
