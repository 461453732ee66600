"""`sao train` / `sao sft` as jobs: exact resume (also into another layout),
SFT -> RL hand-off through `actor.load` (gloo, CPU, tiny Qwen3-MoE, fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_sao.config import load_config
from megatron_sao.jobs.train import run_train
from megatron_sao.rollout.trajectory_io import write_parquet
from tests.training.full_params import checkpoint_tensors
from tests.training.trainer_worker import TIMING_PREFIXES
from tests.training.trajectories import random_trajectories


@pytest.fixture(scope="module")
def trajectories_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recorded") / "trajectories.parquet"
    write_parquet(path, random_trajectories(40, seed=21, long_every=10))
    return path


def _config(tmp_path: Path, hf_dir: Path, trajectories: Path, name: str, *overrides: str):
    return load_config(None, [
        f"run.output_dir={tmp_path}", f"run.name={name}", f"model.hf_path={hf_dir}", "model.dtype=float32",
        "launcher.nproc_per_node=2", "parallelism.expert=2", "logging.param_table=false",
        "logging.wandb_mode=disabled", "rollout.source=recorded", f"data.trajectories_path={trajectories}",
        "data.batch_size=6", "critic.warmup_steps=1", "actor.optim.lr=1e-4", "critic.optim.lr=1e-4",
        "checkpoint.save_every=2", "checkpoint.keep_last=10", *overrides])


def _tensors(iter_dir: Path, role: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(iter_dir / role, tmp_path)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _numeric(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, tiny_hf_dir, trajectories_file) -> dict:
    """4 steps straight; and 2 steps, "killed" (steps 3-4 left in its metrics), resumed to 4 (EP2).
    Step 1 is critic warmup, so the checkpoint at 2 holds both roles' stepped optimizers."""
    root = tmp_path_factory.mktemp("kill_and_resume")
    straight = _config(root, tiny_hf_dir, trajectories_file, "straight", "run.total_steps=4")
    assert run_train(straight)[0] == 0
    first = _config(root, tiny_hf_dir, trajectories_file, "resumed", "run.total_steps=2")
    assert run_train(first)[0] == 0
    # The "killed" run left steps 3-4 in its metrics (logged after its last checkpoint): resuming
    # must drop them, not duplicate them.
    with (root / "resumed" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "actor/loss": 123.0}) + "\n" + '{"step": 4, "actor/lo')
    code, result, _ = run_train(_config(root, tiny_hf_dir, trajectories_file, "resumed", "run.total_steps=4"))
    return {"root": root, "code": code, "result": result}


# Slow (default-suite time, issue 28): exact resume: tests/training/test_checkpoint.py; the loop's
# SIGTERM stop: tests/training/test_loop.py.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_and_resume_is_exact(killed_and_resumed, tmp_path, tiny_hf_dir, trajectories_file):
    root = killed_and_resumed["root"]
    code, result = killed_and_resumed["code"], killed_and_resumed["result"]
    assert code == 0 and result["step"] == 4

    resumed_dir = root / "resumed"
    a, b = root / "straight/checkpoints/iter_0000004", resumed_dir / "checkpoints/iter_0000004"
    assert (resumed_dir / "checkpoints/latest_checkpointed_iteration.txt").read_text().strip() == "4"
    for role in ("actor", "critic"):
        ta, tb = _tensors(a, role, tmp_path), _tensors(b, role, tmp_path)
        assert ta.keys() == tb.keys() and any(k.startswith("optimizer.") for k in ta)
        different = [k for k in ta if not torch.equal(ta[k], tb[k])]
        assert not different, f"{role}: {different[:5]}"
    rows_a, rows_b = _metrics(root / "straight"), _metrics(resumed_dir)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    assert [_numeric(r) for r in rows_a[2:]] == [_numeric(r) for r in rows_b[2:]]
    assert "actor/loss" in rows_b[2]  # the resumed steps update the actor too (past critic warmup)
    assert (resumed_dir / "config.before_step_0000002.yaml").is_file()  # run.total_steps changed

    # A complete run is not trained again.
    code, result, _ = run_train(_config(root, tiny_hf_dir, trajectories_file, "resumed", "run.total_steps=4"))
    assert code == 0 and result["step"] == 4


@pytest.mark.slow  # one more run; resharding on load stays in the default suite (tests/training/test_checkpoint.py)
@pytest.mark.timeout(900)
def test_resume_into_another_layout_matches(killed_and_resumed, tmp_path, tiny_hf_dir, trajectories_file):
    """The step-2 checkpoint of the resumed run, resumed into another layout (EP2 -> DP2): the same
    result as the run that never stopped, within 1e-6."""
    root = killed_and_resumed["root"]
    other = _config(root, tiny_hf_dir, trajectories_file, "relayout", "run.total_steps=4", "parallelism.expert=1",
                    f"checkpoint.resume={root / 'resumed/checkpoints/iter_0000002'}")
    assert run_train(other)[0] == 0
    a, c = root / "straight/checkpoints/iter_0000004", root / "relayout/checkpoints/iter_0000004"
    for role in ("actor", "critic"):
        ta, tc = _tensors(a, role, tmp_path), _tensors(c, role, tmp_path)
        assert ta.keys() == tc.keys()
        worst = max(float((ta[k].double() - tc[k].double()).abs().max()) for k in ta if ta[k].numel())
        assert worst <= 1e-6, f"{role}: {worst}"


def test_engine_source_needs_a_prompt_file(tmp_path, tiny_hf_dir, trajectories_file):
    cfg = _config(tmp_path, tiny_hf_dir, trajectories_file, "engine", "rollout.source=engine",
                  f"data.train_path={tmp_path / 'missing.jsonl'}")
    with pytest.raises(ValueError, match="no such prompt file"):
        run_train(cfg)


@pytest.mark.timeout(900)
@pytest.mark.slow  # ~60-80 s; SFT steps: tests/training/test_trainer_steps.py, a role loaded from a run's
# checkpoint (run, iteration, role, converted): tests/training/test_checkpoint.py (both in the default suite)
def test_sft_checkpoint_starts_rl(tmp_path, tiny_hf_dir, trajectories_file):
    from megatron_sao.platform import run_distributed
    from tests.jobs import load_worker

    sft = _config(tmp_path, tiny_hf_dir, trajectories_file, "sft", "run.total_steps=2", "launcher.nproc_per_node=1",
                  "parallelism.expert=1", "actor.optim.lr=1e-3")
    assert run_train(sft, mode="sft")[0] == 0
    ckpt = tmp_path / "sft" / "checkpoints"
    assert sorted(p.name for p in (ckpt / "iter_0000002").iterdir() if p.is_dir()) == ["actor"]
    saved = _tensors(ckpt / "iter_0000002", "actor", tmp_path)
    # RL in another layout (EP2) starts from the SFT weights, not the HF ones.
    loaded = run_distributed(load_worker.actor_parameters, 2, str(tiny_hf_dir),
                             ["parallelism.expert=2", f"actor.load={ckpt}"])[0]
    fresh = run_distributed(load_worker.actor_parameters, 1, str(tiny_hf_dir), [])[0]
    model_keys = [k for k in loaded if k in saved]
    assert len(model_keys) == len(loaded)
    assert all(torch.equal(loaded[k].to(saved[k].dtype), saved[k]) for k in model_keys)
    assert any(not torch.equal(fresh[k], loaded[k]) for k in model_keys)


@pytest.mark.slow  # ~100 s, a second exact-resume variant of test_kill_and_resume_is_exact
@pytest.mark.timeout(900)
def test_checkpoint_during_critic_warmup_resumes_exactly(tmp_path, tiny_hf_dir, trajectories_file):
    """The actor's optimizer has never stepped when a checkpoint is taken in critic warmup."""
    warm = ["critic.warmup_steps=2", "checkpoint.save_every=1"]
    assert run_train(_config(tmp_path, tiny_hf_dir, trajectories_file, "warm_straight", "run.total_steps=3",
                             *warm))[0] == 0
    assert run_train(_config(tmp_path, tiny_hf_dir, trajectories_file, "warm_resumed", "run.total_steps=1",
                             *warm))[0] == 0
    assert run_train(_config(tmp_path, tiny_hf_dir, trajectories_file, "warm_resumed", "run.total_steps=3",
                             *warm))[0] == 0
    a, b = tmp_path / "warm_straight/checkpoints/iter_0000003", tmp_path / "warm_resumed/checkpoints/iter_0000003"
    for role in ("actor", "critic"):
        ta, tb = _tensors(a, role, tmp_path), _tensors(b, role, tmp_path)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), role
