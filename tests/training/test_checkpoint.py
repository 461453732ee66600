"""Training checkpoints: exact resume, resharding into other layouts, a save killed mid-way, a
flipped byte, pruning, and starting a role from existing weights (gloo ranks, tiny MoE, fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_sao.platform import RankFailed, run_distributed
from megatron_sao.training.checkpoint import files
from tests.training import checkpoint_worker as worker
from tests.training.full_params import checkpoint_tensors


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint

    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)


@pytest.fixture(scope="module")
def launches(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The jobs of `resumed` and `killed` in two launches of 2 gloo ranks instead of four (process
    start-up, imports and the first save are most of each launch): the first runs `resume_source`
    then `save_then_die` (and so ends killed), the second, in fresh processes, `resume_and_reshard`
    then `after_kill`. Per-rank results of the first halves travel through files."""
    root, killed_root = tmp_path_factory.mktemp("resume"), tmp_path_factory.mktemp("killed")
    ckpt, killed_ckpt, snapshot = root / "ckpt", killed_root / "ckpt", killed_root / "step3"
    with pytest.raises(RankFailed) as died:  # rank 0 exits; rank 1 then fails in its collective or is killed
        run_distributed(worker.resume_source_then_save_then_die, 2, str(hf_dir), str(ckpt), str(root / "source"),
                        str(killed_ckpt), str(snapshot), timeout_s=600)
    source = _per_rank(root / "source", died.value)
    listing = sorted(p.name for p in killed_ckpt.iterdir())
    tracker = (killed_ckpt / files.TRACKER_FILE).read_text()
    try:
        second = run_distributed(worker.resume_and_reshard_then_after_kill, 2, str(hf_dir), str(ckpt),
                                 str(root / "out"), str(root / "target"), str(killed_ckpt), str(snapshot),
                                 str(killed_root))
        after, failure = [r["after"] for r in second], None
    except RankFailed as e:
        after, failure = None, e
    return {"resumed": {"root": root, "source": source, "target": _per_rank(root / "target", failure)},
            "killed": {"root": killed_root, "listing": listing, "tracker": tracker, "after": after},
            "failure": failure}


def _per_rank(path: Path, failure: BaseException | None) -> list:
    """The results a launch left in `path`.rank0 / .rank1 (its failure, when it left none)."""
    found = [Path(f"{path}.rank{r}") for r in range(2)]
    if not all(f.is_file() for f in found):
        raise AssertionError(f"no results at {path}.rankN; the launch failed with:\n{failure}")
    return [torch.load(f) for f in found]


@pytest.fixture(scope="module")
def resumed(launches: dict) -> dict:
    """EP2 with the distributed optimizer: 6 steps straight (saving at 3 and 4) vs load 3 + 3 steps in
    fresh processes; then the step-3 checkpoint loaded into DP2, re-saved, one step taken and saved."""
    return launches["resumed"]


@pytest.fixture(scope="module")
def resharded_other_layouts(resumed: dict, hf_dir: Path) -> dict:
    """Slow part of the resharding: the step-3 checkpoint loaded into TP2, TP2 -> TP1 (DP2) and PP2 and
    re-saved (fresh processes; only the slow parameters of the reshard test ask for it)."""
    root = resumed["root"]
    run_distributed(worker.reshard_other_layouts, 2, str(hf_dir), str(root / "ckpt"), str(root / "out"))
    return resumed


@pytest.fixture(scope="module")
def killed(launches: dict) -> dict:
    """Plain optimizer, DP2: saves at 1, 2, 3 (keep_last=2), killed inside the save of 4; then resumed."""
    if launches["failure"] is not None:
        raise launches["failure"]
    return launches["killed"]


def test_resume_is_bit_identical_to_an_uninterrupted_run(resumed):
    """Every parameter, exp_avg, exp_avg_sq, Adam step, group LR and scheduler step count on every rank."""
    for rank in range(2):
        straight, resumed_state = resumed["source"][rank]["state"], resumed["target"][rank]["state"]
        assert straight.keys() == resumed_state.keys()
        assert any("/optim/" in k and k.endswith("/exp_avg_sq") for k in straight)
        differing = [k for k in straight if not torch.equal(straight[k], resumed_state[k])]
        assert differing == [], f"rank {rank}: {differing[:5]}"
        steps = {float(v) for k, v in straight.items() if k.endswith("/step")}
        assert steps == {6.0} and int(straight["critic/scheduler_steps"]) == 6


def test_resume_restores_rng_and_trainer_state(resumed):
    for rank in range(2):
        assert torch.equal(resumed["source"][rank]["rng_after_save"], resumed["target"][rank]["rng_after_load"])
        assert resumed["target"][rank]["trainer_state"] == {"step": 3, "data_position": 12}
    assert resumed["target"][0]["latest"].endswith("iter_0000004")


# EP2 -> DP2 runs in the default suite (the `resumed` job); the other layouts are slow (a job of their own).
SLOW_LAYOUTS = {"marks": pytest.mark.slow}


@pytest.mark.parametrize(("saved", "resaved", "job"), [
    pytest.param("ckpt/iter_0000003", "out/dp2/iter_0000003", "resumed", id="ep2_to_dp2"),
    pytest.param("ckpt/iter_0000004", "out/dp2/iter_0000004", "resumed", id="ep2_to_dp2_then_a_step"),
    pytest.param("ckpt/iter_0000003", "out/tp2/iter_0000003", "resharded_other_layouts", id="ep2_to_tp2",
                 **SLOW_LAYOUTS),
    pytest.param("ckpt/iter_0000003", "out/tp1/iter_0000003", "resharded_other_layouts", id="tp2_to_tp1_dp2",
                 **SLOW_LAYOUTS),
    pytest.param("ckpt/iter_0000003", "out/pp2/iter_0000003", "resharded_other_layouts", id="ep2_to_pp2",
                 **SLOW_LAYOUTS),
])
def test_layout_change_reshards_model_and_optimizer(request, tmp_path, saved, resaved, job):
    """Loaded into another layout and saved again: every model and optimizer tensor equal within 1e-6."""
    root = request.getfixturevalue(job)["root"]
    for role in ("actor", "critic"):
        a = checkpoint_tensors(root / saved / role, tmp_path)
        b = checkpoint_tensors(root / resaved / role, tmp_path)
        assert a.keys() == b.keys()
        for prefix in ("optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.", "optimizer.state.param."):
            assert any(k.startswith(prefix) for k in a), prefix
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=lambda m, k=key, r=role: f"{r} {k}: {m}")


def test_checkpoint_directory_layout(resumed):
    ckpt = resumed["root"] / "ckpt"
    assert (ckpt / files.TRACKER_FILE).read_text() == "4\n"
    iter_dir = ckpt / "iter_0000003"
    assert json.loads((iter_dir / files.TRAINER_STATE_FILE).read_text()) == {"step": 3, "data_position": 12}
    manifest = files.read_manifest(iter_dir)
    assert manifest.step == 3 and manifest.roles == ["actor", "critic"]
    assert manifest.layout["expert"] == 2 and manifest.optimizer_format == {"actor": "fully_reshardable",
                                                                           "critic": "fully_reshardable"}
    for role in ("actor", "critic"):
        for name in ("metadata.json", ".metadata"):
            assert f"{role}/{name}" in manifest.files
        assert any(n.startswith(f"{role}/") and n.endswith(".distcp") for n in manifest.files)
    assert files.TRAINER_STATE_FILE in manifest.files
    assert not list(ckpt.glob("*.partial"))


def test_kill_during_save_keeps_the_previous_checkpoint_as_latest(killed):
    assert "iter_0000004.partial" in killed["listing"] and "iter_0000004" not in killed["listing"]
    assert killed["tracker"] == "3\n"
    for rank_result in killed["after"]:
        assert rank_result["latest"].endswith("iter_0000003")
        assert rank_result["trainer_state"] == {"step": 3}
        assert rank_result["resumed_equal"], "plain optimizer: state after load differs from the state saved"


def test_keep_last_prunes_older_checkpoints(killed):
    complete = [n for n in killed["listing"] if files.step_of(Path(n)) is not None]
    assert complete == ["iter_0000002", "iter_0000003"]


def test_load_model_weights_from_every_accepted_path(killed):
    root = killed["root"]
    weights = killed["after"][0]["weights"]
    assert weights["run"]["dir"] == str(root / "ckpt" / "iter_0000003" / "actor")
    assert weights["iter"]["dir"] == weights["role"]["dir"] == weights["run"]["dir"]
    assert weights["converted"]["dir"] == str(root / "converted_actor")
    assert weights["critic_run"]["dir"] == str(root / "ckpt" / "iter_0000003" / "critic")
    for rank_result in killed["after"]:
        assert all(w["matches"] for w in rank_result["weights"].values()), rank_result["weights"]
        assert rank_result["fastio_loaded"] == [], "the loads (or the standard-path conversion) used fast I/O"


def test_load_model_weights_rejects_what_it_cannot_load(killed):
    errors = killed["after"][0]["errors"]
    assert "not_a_checkpoint" in errors["bad_path"] and "not a megatron-sao checkpoint" in errors["bad_path"]
    assert "critic's directory, not the actor's" in errors["wrong_role"]
    assert "converted actor checkpoint, not a critic one" in errors["converted_as_critic"]


def test_flipped_byte_is_reported_with_the_file_name(killed):
    for rank_result in killed["after"]:
        assert rank_result["flipped"] in rank_result["flipped_error"]
        assert "corrupt" in rank_result["flipped_error"]


# --- the directory logic alone (no processes) ---

def _fake_checkpoint(ckpt: Path, step: int) -> Path:
    iter_dir = ckpt / files.iter_dir_name(step)
    iter_dir.mkdir(parents=True)
    manifest = files.CheckpointManifest(step=step, roles=["actor"], layout={}, optimizer_format={})
    files.write_manifest(iter_dir, manifest)
    return iter_dir


def test_latest_falls_back_when_the_tracker_is_missing_or_stale(tmp_path):
    assert files.find_latest_checkpoint(tmp_path) is None
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 10)
    (tmp_path / "iter_0000011.partial").mkdir()
    (tmp_path / "iter_0000012").mkdir()  # no manifest: not complete
    assert files.find_latest_checkpoint(tmp_path) == newest  # no tracker
    files.write_tracker(tmp_path, 2)
    assert files.find_latest_checkpoint(tmp_path) == tmp_path / "iter_0000002"
    files.write_tracker(tmp_path, 7)  # names a directory that is gone
    assert files.find_latest_checkpoint(tmp_path) == newest
    (tmp_path / files.TRACKER_FILE).write_text("garbage")
    assert files.find_latest_checkpoint(tmp_path) == newest


def test_prune_keeps_the_newest_and_removes_stale_partials(tmp_path):
    for step in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "iter_0000002.partial").mkdir()
    (tmp_path / "iter_0000009.partial").mkdir()  # a newer save in progress is left alone
    files.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", "iter_0000009.partial"]
    files.prune(tmp_path, keep_last=0)
    assert len(files.complete_iter_dirs(tmp_path)) == 2


def test_verify_files_names_missing_truncated_and_changed_files(tmp_path):
    (tmp_path / "a").write_bytes(b"hello")
    (tmp_path / "b").write_bytes(b"world")
    (tmp_path / "c").write_bytes(b"!")
    table = files.hash_and_sync(tmp_path, ["a", "b", "c"])
    assert files.verify_files(tmp_path, table, ["a", "b", "c"]) == []
    (tmp_path / "a").write_bytes(b"hellO")
    (tmp_path / "b").write_bytes(b"wor")
    (tmp_path / "c").unlink()
    errors = files.verify_files(tmp_path, table, ["a", "b", "c"])
    assert [e.split(":")[0] for e in errors] == [str(tmp_path / n) for n in ("a", "b", "c")]
    assert "corrupt" in errors[0] and "bytes" in errors[1] and "missing" in errors[2]
    assert files.my_share(["x", "y", "z"], 1, 2) == ["y"]


@pytest.mark.slow
def test_async_save_completes_only_at_finalize(hf_dir, tmp_path):
    """The GPU async path, forced on CPU (actor only, as a run without critic saves): the directory
    appears at `finalize_async_saves`, and holds the state of the step it was started at although
    training went on meanwhile."""
    ranks = run_distributed(worker.async_save_round_trip, 2, str(hf_dir), str(tmp_path / "ckpt"))
    for result in ranks:
        assert result == {"complete_before_finalize": False, "complete": True, "equal": True}
    assert (tmp_path / "ckpt" / files.TRACKER_FILE).read_text() == "1\n"
    assert files.read_manifest(tmp_path / "ckpt" / "iter_0000001").roles == ["actor"]
