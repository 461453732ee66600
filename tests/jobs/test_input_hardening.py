"""Bad input on the scale-side commands (issue 32): `sao train` on recorded data, `sao value-pretrain`,
`sao plan`, `sao report`, `sao convert`, `sao demo`. Each case: the exit code, the one line the
terminal shows, and for the checks a job makes before its ranks (items 1, 2) that no rank started
and no model was built (`no_ranks`), within a few seconds.

Items: 1 recorded trajectories, 2 user errors from ranks, 5 output paths, 6 plan / config.json /
index / metrics naming, 7 report on a cut or a parent directory, 8 the smaller ones. Items 3 and
4 (Ray authentication, `sao launch slurm`) are in tests/launchers/test_launch_hardening.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_sao.cli import main
from megatron_sao.rollout.trajectory_io import trajectory_to_dict, write_parquet
from megatron_sao.valuepretrain.corpus import write_corpus
from tests.training.trajectories import random_trajectories

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")
SCALE = str(REPO / "recipes" / "qwen3_30b_a3b_math_sao.yaml")
PARENT_BOUND_S = 10.0
"""Checks in the parent: well under one tiny model build with its ranks (~15-30 s on the 2-core VM)."""


@pytest.fixture(autouse=True)
def _logs_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands' default log files (`sao-<command>-*.log` in the temp directory) go to tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a rank or building a model fails the test: the error must come before either."""
    import megatron_sao.models.build as build
    import megatron_sao.platform as platform
    import megatron_sao.platform.spawn as spawn

    def forbidden(*args, **kwargs):
        raise AssertionError("a rank was started or a model built before the error")

    for module, name in ((platform, "run_distributed"), (spawn, "run_distributed"), (build, "build_model")):
        monkeypatch.setattr(module, name, forbidden)


def sao(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], float]:
    """(exit code, the command's own stderr lines, seconds) of an in-process `sao ARGV`. In process,
    a library whose log handler was made before the command (torch's, at the test session's first
    import) still writes to the test's stderr: those lines are dropped here; the subprocess tests
    below check the whole terminal."""
    start = time.monotonic()
    code = main(list(argv))
    elapsed = time.monotonic() - start
    lines = capfd.readouterr().err.strip().splitlines()
    return code, [line for line in lines if not re.match(r"[WI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ torch/", line)], elapsed


def sao_process(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`sao ARGV` as a user runs it: its own process, stdout and stderr as the terminal shows them."""
    return subprocess.run([sys.executable, "-m", "megatron_sao.cli", *argv], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)})


def _train(tmp_path: Path, hf_dir: Path, trajectories: Path | str, *more: str) -> list[str]:
    return ["train", TINY, f"run.output_dir={tmp_path / 'runs'}", f"model.hf_path={hf_dir}",
            f"data.trajectories_path={trajectories}", "logging.wandb_mode=disabled", "run.total_steps=1",
            "data.batch_size=4", *more]


# ---- 1: recorded trajectories ---------------------------------------------------------------------


def _wrong_schema(path: Path) -> None:
    pq.write_table(pa.table({"trajectory_id": ["a"], "tokens": [[1, 2, 3]]}), path)


def _jsonl_missing(path: Path) -> None:
    row = trajectory_to_dict(random_trajectories(1)[0])
    del row["loss_mask"], row["rewards"]
    path.write_text(json.dumps(row) + "\n")


@pytest.mark.parametrize("name, make, message", [
    ("empty.parquet", lambda p: p.write_bytes(b""), r"trajectory file {p} is empty"),
    ("empty.jsonl", lambda p: p.write_text(""), r"trajectory file {p} is empty"),
    ("zero_rows.parquet", lambda p: write_parquet(p, []), r"trajectory file {p} has no rows"),
    ("blank.jsonl", lambda p: p.write_text("\n\n[1, 2]\n"), r"trajectory file {p} has no row that is a JSON object"),
    ("schema.parquet", _wrong_schema,
     r"trajectory file {p} is not a trajectory file: its schema lacks the column\(s\) prompt_id, token_ids, "
     r"loss_mask, .*metadata_json"),
    ("schema.jsonl", _jsonl_missing,
     r"trajectory file {p} is not a trajectory file: its first record \(line 1\) lacks the column\(s\) loss_mask, "
     r"rewards \("),
])
def test_item1_a_recorded_file_without_rows_or_columns_fails_in_the_parent(
        tmp_path, tiny_hf_dir, capfd, no_ranks, name, make, message):
    path = tmp_path / name
    make(path)
    code, err, elapsed = sao(capfd, *_train(tmp_path, tiny_hf_dir, path))
    assert code == 2
    assert len(err) == 1 and err[0].startswith("sao train: error: ")
    assert re.search(message.format(p=re.escape(str(path))), err[0]), err[0]
    assert elapsed < PARENT_BOUND_S


def test_item1_a_wrong_schema_is_one_line_on_the_terminal_within_seconds(tmp_path, tiny_hf_dir):
    path = tmp_path / "other.parquet"
    _wrong_schema(path)
    start = time.monotonic()
    proc = sao_process(tmp_path, *_train(tmp_path, tiny_hf_dir, path))
    elapsed = time.monotonic() - start
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"sao train: error: trajectory file {path} is not a trajectory file: its schema lacks the column(s) "
        "prompt_id, token_ids, loss_mask, rollout_logprobs, policy_versions, prompt_length, turns, rewards, status, "
        "status_reason, timings, num_engine_calls, num_engine_retries, metadata_json (written by `trajectory_io`? see "
        "docs/training.md)"]
    assert elapsed < 2 * PARENT_BOUND_S  # a fresh interpreter imports torch first
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # ~40 s: two ranks build the tiny actor and critic before reading the file
@pytest.mark.timeout(600)
def test_item1_item2_out_of_vocabulary_rows_are_skipped_named_and_all_of_them_is_one_user_error(
        tmp_path, tiny_hf_dir, capfd):
    """Every row holds ids the embedding has no row for: each rank skips and names them, then the
    run stops with the file's one-line error, once (TP1 used to crash with a bare IndexError)."""
    path = tmp_path / "out_of_vocab.parquet"
    write_parquet(path, random_trajectories(6, seed=4, vocab=1_000_000))
    code, err, _ = sao(capfd, *_train(tmp_path, tiny_hf_dir, path))
    assert code == 2
    assert err[-1] == (f"sao train: error: trajectory file {path} has no valid trajectory (0/6 rows loaded; skipped: "
                       "out_of_vocabulary=6)")
    assert sum("has no valid trajectory" in line for line in err) == 1  # once, not once per rank
    assert not any("RankFailed" in line or "rank 0 failed" in line or "internal error" in line for line in err)
    assert any(f"skipping {path} row 1: token id" in line and "outside the model's vocabulary [0, 320)" in line
               for line in err)


# ---- 2: user errors from ranks ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recorded") / "t.parquet"
    write_parquet(path, random_trajectories(8, seed=2))
    return path


def test_item2_a_missing_actor_load_is_refused_before_the_ranks(tmp_path, tiny_hf_dir, recorded, capfd, no_ranks):
    code, err, elapsed = sao(capfd, *_train(tmp_path, tiny_hf_dir, recorded, f"actor.load={tmp_path / 'nowhere'}"))
    assert code == 2
    assert err == [f"sao train: error: actor.load={tmp_path / 'nowhere'}: no such directory"]
    assert elapsed < PARENT_BOUND_S


def _corpus(root: Path) -> Path:
    corpus = root / "corpus"
    write_corpus(corpus, random_trajectories(24, seed=6), seed=0, heldout_fraction=0.0, trajectories_per_shard=8,
                 row_group_size=4)
    return corpus


def _pretrain(tmp_path: Path, hf_dir: Path, corpus: Path, *more: str) -> list[str]:
    return ["value-pretrain", "train", TINY, f"run.output_dir={tmp_path / 'runs'}", "run.name=vp",
            f"model.hf_path={hf_dir}", f"value_pretrain.corpus_dir={corpus}",
            "logging.wandb_mode=disabled", "run.total_steps=1", "data.batch_size=4", "launcher.nproc_per_node=1",
            "parallelism.expert=1", *more]


@pytest.mark.parametrize("manifest, message", [
    ([], r"not a valid corpus manifest: a JSON list, expected an object"),
    ({"format_version": 1, "shards": {"train-00000.parquet": {}}}, r"field shards is a dict, expected a list"),
    ({"format_version": 1, "shards": [{"name": "train-00000.parquet"}]}, r"shards\[0\]\.split is missing"),
    ({"format_version": 1, "shards": [7]}, r"shards\[0\] is a int, expected an object"),
])
def test_item2_a_manifest_of_the_wrong_shape_is_a_user_error_before_the_ranks(
        tmp_path, tiny_hf_dir, capfd, no_ranks, manifest, message):
    corpus = _corpus(tmp_path)
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    code, err, elapsed = sao(capfd, *_pretrain(tmp_path, tiny_hf_dir, corpus))
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"sao value-pretrain: error: {corpus / 'manifest.json'}: not a valid corpus manifest")
    assert re.search(message, err[0]), err[0]
    assert elapsed < PARENT_BOUND_S


def test_item2_a_missing_shard_stops_before_the_ranks(tmp_path, tiny_hf_dir, capfd, no_ranks):
    corpus = _corpus(tmp_path)
    (corpus / "train-00001.parquet").unlink()
    code, err, elapsed = sao(capfd, *_pretrain(tmp_path, tiny_hf_dir, corpus))
    assert code == 2 and len(err) == 1
    assert err[0].startswith("sao value-pretrain: error: 1 bad corpus shard(s): train-00001.parquet: missing")
    assert elapsed < PARENT_BOUND_S


@pytest.mark.timeout(300)
def test_item2_a_shard_only_a_rank_finds_bad_is_still_one_user_error(tmp_path, tiny_hf_dir, capfd):
    """A shard whose bytes changed after the manifest (its footer still reads): only the rank's
    SHA-256 check finds it. The rank's BadShardError comes out as exit 2, its own message the last
    line, once; no traceback on the terminal."""
    corpus = _corpus(tmp_path)
    shard = corpus / "train-00002.parquet"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF  # a data page, not the footer
    shard.write_bytes(bytes(data))
    code, err, _ = sao(capfd, *_pretrain(tmp_path, tiny_hf_dir, corpus))
    assert code == 2
    assert err[-1].startswith("sao value-pretrain: error: 1 bad corpus shard(s): train-00002.parquet: hash_mismatch")
    assert sum(line.startswith("sao value-pretrain") for line in err) == 1
    assert not any("Traceback" in line or "rank 0 failed" in line for line in err)


# ---- 5: output paths ---------------------------------------------------------------------------------


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory this process cannot write: mode 0555 for a normal user; for root (who ignores
    modes) a read-only tmpfs mounted there."""
    path = tmp_path / "read_only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True,
                           text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs as root: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_item5_train_output_dir_that_is_a_file_or_read_only(tmp_path, tiny_hf_dir, recorded, read_only_dir, capfd,
                                                            no_ranks):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    argv = _train(tmp_path, tiny_hf_dir, recorded)
    code, err, _ = sao(capfd, *[a if not a.startswith("run.output_dir=") else f"run.output_dir={blocker}"
                                for a in argv])
    assert code == 2 and err == [f"sao train: error: run directory (run.output_dir/run.name) {blocker / 'tiny_cpu'}: "
                                 f"a file is in the way, not a directory ({blocker} is one)"]
    code, err, _ = sao(capfd, *[a if not a.startswith("run.output_dir=") else f"run.output_dir={read_only_dir}"
                                for a in argv])
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"sao train: error: run directory (run.output_dir/run.name) {read_only_dir / 'tiny_cpu'}: "
                             "cannot write there (")


def test_item5_value_pretrain_and_report_out(tmp_path, tiny_hf_dir, read_only_dir, capfd, no_ranks):
    corpus = _corpus(tmp_path)
    argv = _pretrain(tmp_path, tiny_hf_dir, corpus)
    code, err, _ = sao(capfd, *[a if not a.startswith("run.output_dir=") else f"run.output_dir={read_only_dir}"
                                for a in argv])
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"sao value-pretrain: error: run directory (run.output_dir/run.name) "
                             f"{read_only_dir / 'vp'}: cannot write there")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "train/reward_mean": 0.5}\n')
    code, err, _ = sao(capfd, "report", str(run), "--out", str(read_only_dir / "report"))
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"sao report: error: --out {read_only_dir / 'report'}: cannot write there (")
    (tmp_path / "f").write_text("x")
    code, err, _ = sao(capfd, "report", str(run), "--out", str(tmp_path / "f"))
    assert code == 2 and err == [f"sao report: error: --out {tmp_path / 'f'}: a file is in the way, not a directory"]


# ---- 6: sao plan, config.json, safetensors index, metrics file ----------------------------------------


def _model_dir(tmp_path: Path, config: object, name: str = "model") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_item6_plan_refuses_families_it_cannot_convert_or_train(tmp_path, capfd):
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "intermediate_size": 128}
    model = _model_dir(tmp_path, llama)
    code, err, _ = sao(capfd, "plan", TINY, f"model.hf_path={model}", "model.build_tiny=false", "parallelism.expert=2")
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"sao plan: error: model.hf_path: {model / 'config.json'}: unsupported architecture "
                             "LlamaForCausalLM; supported: DeepseekV3ForCausalLM, Glm4MoeForCausalLM, "
                             "GlmMoeDsaForCausalLM, Qwen3MoeForCausalLM")


def test_item6_plan_refuses_expert_parallelism_on_a_dense_model(tmp_path, capfd):
    config = json.loads((REPO / "recipes/models/qwen3_30b_a3b_thinking_2507/config.json").read_text())
    config["num_experts"] = 0
    model = _model_dir(tmp_path, config)
    code, err, _ = sao(capfd, "plan", SCALE, f"model.hf_path={model}")
    assert code == 2 and len(err) == 1
    assert err[0].startswith("sao plan: config error: parallelism.expert = 32 but the model has no experts (a dense "
                             f"model, in {SCALE})")


@pytest.mark.parametrize("text, message", [
    ("{not json", r"{f}: not valid JSON \("),
    ("[1, 2]", r"{f}: expected a JSON object, got a list"),
    ('{"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 320}',
     r"{f}: field num_hidden_layers is missing, expected a positive integer"),
    ('{"model_type": "qwen3_moe", "num_hidden_layers": "two", "hidden_size": 64, "num_attention_heads": 4, '
     '"vocab_size": 320}', r"{f}: field num_hidden_layers is 'two', expected a positive integer"),
])
def test_item6_a_malformed_config_json_names_the_file_and_field(tmp_path, capfd, text, message):
    model = _model_dir(tmp_path, text)
    code, err, _ = sao(capfd, "plan", TINY, f"model.hf_path={model}", "model.build_tiny=false")
    assert code == 2 and len(err) == 1
    assert re.fullmatch("sao plan: error: " + message.format(f=re.escape(str(model / "config.json"))) + ".*",
                        err[0]), err[0]


def test_item6_a_broken_safetensors_index_is_named(tmp_path, tiny_hf_dir):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf_dir, hf)
    (hf / "model.safetensors.index.json").write_text('{"weight_map": ')
    # In its own process: the conversion initialises torch.distributed before it reads the source.
    proc = sao_process(tmp_path, "convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith(f"sao convert: error: {hf / 'model.safetensors.index.json'}: not valid JSON (")
    (hf / "model.safetensors.index.json").write_text('{"metadata": {}}')
    proc = sao_process(tmp_path, "convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"sao convert: error: {hf / 'model.safetensors.index.json'}: field weight_map is missing, expected an object "
        "mapping tensor names to file names")


def test_item6_a_non_utf8_metrics_file_is_named(tmp_path, capfd):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2, "note": "caf\xe9"}\n')
    code, err, _ = sao(capfd, "report", str(run))
    assert code == 2 and err == [f"sao report: error: {run / 'metrics.jsonl'}:2: not UTF-8 text (byte 24 of the line)"]


# ---- 7: sao report on a running or killed run, and on `sao demo`'s parent directory -------------------


def test_item7_report_skips_a_cut_last_line_with_a_warning(tmp_path, capfd):
    run = tmp_path / "run"
    run.mkdir()
    rows = [json.dumps({"step": s, "train/reward_mean": s / 10, "critic/explained_variance": 0.1 * s}) for s in (1, 2)]
    (run / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 3, "train/rew')
    proc = sao_process(tmp_path, "report", str(run))
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == str(run / "report" / "index.html")
    assert f"{run / 'metrics.jsonl'}:3: skipping the last line, cut short (a running or killed run)" in proc.stderr
    (run / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 3, "train/rew\n')  # a whole bad line: an error
    code, err, _ = sao(capfd, "report", str(run))
    assert code == 2 and err[-1].startswith(f"sao report: error: {run / 'metrics.jsonl'}:3: not a metrics line")


def test_item7_report_on_the_demo_directory_lists_its_runs(tmp_path, capfd):
    demo = tmp_path / "runs" / "tiny_cpu"
    for stage in ("sft", "value", "sao"):
        (demo / stage).mkdir(parents=True)
        (demo / stage / "metrics.jsonl").write_text('{"step": 1}\n')
    (demo / "mcore").mkdir()
    code, err, _ = sao(capfd, "report", str(demo))
    assert code == 2 and err == [f"sao report: error: {demo} is not a run directory (no metrics.jsonl) but holds 3: "
                                 f"{demo / 'sao'}, {demo / 'sft'}, {demo / 'value'}; report one of them"]


# ---- 8: the smaller ones --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mcore_dir(tmp_path_factory, tiny_hf_dir) -> Path:
    out = tmp_path_factory.mktemp("mcore") / "mcore"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    for _ in range(3):  # a one-process conversion binds a port found free a moment before: another test may take it
        proc = subprocess.run([sys.executable, "-m", "megatron_sao.cli", "convert", "hf-to-mcore", "--hf",
                               str(tiny_hf_dir), "--out", str(out), "--overwrite"], capture_output=True, text=True,
                              env=env)
        if "EADDRINUSE" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.slow
def test_item8_verify_names_swapped_directories_and_a_config_that_disagrees_with_the_weights(
        tmp_path, tiny_hf_dir, mcore_dir, capfd):
    log = str(tmp_path / "log")
    code, err, _ = sao(capfd, "convert", "verify", "--hf", str(mcore_dir), "--mcore", str(tiny_hf_dir),
                       "--log-file", log)
    assert code == 2 and err == [f"sao convert: error: --hf and --mcore are swapped: --hf {mcore_dir} is a Megatron "
                                 f"checkpoint (sao_manifest.json) and --mcore {tiny_hf_dir} a HuggingFace one "
                                 f"(config.json); use --hf {tiny_hf_dir} --mcore {mcore_dir}"]
    wider = tmp_path / "wider"
    shutil.copytree(tiny_hf_dir, wider)
    config = json.loads((wider / "config.json").read_text())
    config["hidden_size"] *= 2
    (wider / "config.json").write_text(json.dumps(config))
    code, err, _ = sao(capfd, "convert", "verify", "--hf", str(wider), "--mcore", str(mcore_dir), "--log-file", log)
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"sao convert: error: {wider}: config/weights mismatch for tensor ")
    assert "config.json implies shape" in err[0]


def test_item8_a_recipe_with_a_section_twice_is_an_error(tmp_path, capfd):
    recipe = tmp_path / "twice.yaml"
    recipe.write_text(f"base: {TINY}\nactor:\n  micro_batch_size: 2\nrun:\n  seed: 1\nactor:\n  micro_batch_size: 8\n")
    code, err, _ = sao(capfd, "config", "show", str(recipe))
    assert code == 2 and err == [f"sao config: config error: {recipe} line 6: duplicate key 'actor' (first at line "
                                 "2): merge the two into one"]


def test_item8_demo_on_a_recipe_without_weights_is_a_user_error(tmp_path, capfd):
    code, err, elapsed = sao(capfd, "demo", SCALE, f"run.output_dir={tmp_path}", "--log-file", str(tmp_path / "log"))
    model = REPO / "recipes" / "models" / "qwen3_30b_a3b_thinking_2507"
    assert code == 2 and err == [f"sao demo: error: {model}: no model weights (no model.safetensors.index.json and no "
                                 "*.safetensors)"]
    assert elapsed < PARENT_BOUND_S


@pytest.mark.parametrize("argv, message", [
    (["plan", TINY, "--avg-tokens", "0"], "argument --avg-tokens: must be >= 1, got 0"),
    (["plan", TINY, "--mfu", "1.5"], "argument --mfu: must be a finite number > 0 and <= 1, got 1.5"),
    (["report", "x", "--compare", "y", "--phase-steps", "-3"], "argument --phase-steps: must be >= 1, got -3"),
    (["convert", "hf-to-mcore", "--hf", "a", "--out", "b", "--nproc", "0"], "argument --nproc: must be >= 1, got 0"),
    (["convert", "verify", "--hf", "a", "--mcore", "b", "--tolerance", "nan"],
     "argument --tolerance: must be a finite number >= 0, got nan"),
    (["launch", "slurm", TINY, "--join-timeout", "0"], "argument --join-timeout: must be >= 1, got 0"),
    (["launch", "local", TINY, "--cpus-per-node", "-1"], "argument --cpus-per-node: must be >= 1, got -1"),
    (["launch", "slurm", TINY, "--time", "1h"], "argument --time: time limit '1h' is not a Slurm time"),
    (["plan", TINY, "--js"], "unrecognized arguments: --js"),  # no abbreviation of --json
    (["launch", "slurm", TINY, "--node", "2"], "unrecognized arguments: --node 2"),  # nor of --nodes
    (["convert", "verify", "--hf", "a", "--mc", "b"], "the following arguments are required: --mcore"),
])
def test_item8_numbers_are_checked_and_options_are_never_abbreviated(capfd, argv, message):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert message in capfd.readouterr().err.strip().splitlines()[-1]


def test_item8_third_party_output_before_a_one_line_error_goes_to_the_log(tmp_path):
    """Importing Megatron prints a dozen warnings; before the command's error they go to its log."""
    proc = sao_process(tmp_path, "value-pretrain", "train", TINY, f"run.output_dir={tmp_path}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"sao value-pretrain: error: value_pretrain.corpus_dir: "
                                                f"{tmp_path / 'tiny_cpu' / 'corpus'} holds no corpus (manifest.json); "
                                                "write one with `sao value-pretrain generate` first"]
    [log] = tmp_path.glob("sao-value-pretrain-*.log")  # the default log, in the temp directory
    assert "Warning" in log.read_text()
