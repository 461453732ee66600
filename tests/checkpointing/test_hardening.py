"""Conversion safety and honest output (issue 14): an --out that is, contains or sits inside a
source is refused whatever the flags (finding 2); --overwrite replaces only a previous conversion
output; checksums are verified by default; leftovers of killed runs are reported (and removable);
a read-only destination is one line; third-party output goes to a log file and the result is the
last line, with the documented exit codes (finding 5). Plus the guards that no test triggered:
the export's extra / missing / wrong-shape checks, the dropped-HF-tensor check at every position,
and the NaN completeness check over persistent buffers."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_sao.checkpointing.hf_load import LoadSpec, _check_tasks, float_state
from megatron_sao.checkpointing.hf_to_mcore import HfToMcoreRequest, plan_hf_to_mcore
from megatron_sao.checkpointing.output_dir import TMP_MARKER, disk_full_as_value_error, report_leftovers
from megatron_sao.models.hf_files import HFCheckpoint, TensorInfo
from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint
from megatron_sao.platform import run_distributed
from megatron_sao.utils.console import EXIT_CHECK_FAILED, EXIT_INTERNAL_ERROR, EXIT_USER_ERROR, run_command
from tests.checkpointing._guard_jobs import export_with_doctored_manifests

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("pristine") / "hf", family="qwen3_moe")


@pytest.fixture
def nested(pristine: Path, tmp_path: Path) -> Path:
    """X/hf: the layout of finding 2 (`--hf X/hf --out X --overwrite` replaced X)."""
    shutil.copytree(pristine, tmp_path / "X" / "hf")
    return tmp_path / "X"


def plan(hf_dir: Path, out: Path, **kw):
    return plan_hf_to_mcore(HfToMcoreRequest(hf_dir=hf_dir, out_dir=out, **kw))


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("out, relation", [(".", "contains"), ("hf", "is"), ("hf/inner", "sits inside")])
def test_output_overlapping_the_source_is_refused_with_or_without_overwrite(nested, out, relation, overwrite):
    with pytest.raises(ValueError, match=rf"output .* {relation} the source .*refused \(with or without --overwrite\)"):
        plan(nested / "hf", nested / out, overwrite=overwrite)
    assert (nested / "hf" / "model.safetensors").is_file()


def test_finding_2_cli_refuses_and_the_source_survives(nested):
    """The exact command of finding 2, through the real CLI: exit 2, one line, nothing deleted."""
    before = sorted(p.name for p in (nested / "hf").iterdir())
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_hf_to_mcore.py"), "--hf", str(nested / "hf"),
                           "--out", str(nested), "--overwrite", "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("sao convert: error: output ")
    assert "contains the source" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in (nested / "hf").iterdir()) == before


def test_overwrite_replaces_only_a_previous_conversion_output(pristine, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"is not a previous conversion output .*--overwrite replaces only"):
        plan(pristine, out, overwrite=True)
    (out / "sao_manifest.json").write_text("{}")
    assert plan(pristine, out, overwrite=True).role == "actor"
    (out / "sao_manifest.json").unlink()
    (out / "sao_export.json").write_text("{}")
    assert plan(pristine, out, overwrite=True).role == "actor"


def test_read_only_destination_is_one_line(pristine, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=rf"cannot write the output {tmp_path / 'out'}: .* read-only or not "
                                         "writable"):
        plan(pristine, tmp_path / "out")
    with pytest.raises(ValueError, match=r"cannot write .*: read-only or permission denied"), \
            disk_full_as_value_error(tmp_path):
        raise OSError(errno.EROFS, "Read-only file system")


def test_leftovers_of_killed_runs_are_reported_and_removable(tmp_path):
    out = tmp_path / "ckpt"
    stale = tmp_path / f".ckpt{TMP_MARKER}0123abcd"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "shard").write_bytes(b"x" * 2000)
    (tmp_path / f".other{TMP_MARKER}1").mkdir()  # another output's: not ours to report
    [note] = report_leftovers(out, remove=False)
    assert note.startswith("note: 1 leftover temporary directories") and "2.00 KB" in note
    assert "--remove-leftovers" in note and stale.is_dir()
    [done] = report_leftovers(out, remove=True)
    assert done.startswith("removed 1 leftover") and not stale.exists()
    assert (tmp_path / f".other{TMP_MARKER}1").is_dir() and report_leftovers(out, remove=False) == []


# ---- output and exit codes (finding 5) -----------------------------------------------------------


def _raise(error: BaseException):
    def func(_args):
        raise error
    return func


@pytest.mark.parametrize("func, code, last", [
    (lambda a: 0, 0, None),
    (lambda a: 1, EXIT_CHECK_FAILED, None),
    (_raise(ValueError("bad --hf")), EXIT_USER_ERROR, "sao convert: error: bad --hf"),
    (_raise(NotImplementedError("fp8")), EXIT_USER_ERROR, "sao convert: error: fp8"),
    (_raise(RuntimeError("boom\nsecond line")), EXIT_INTERNAL_ERROR, "sao convert: internal error: RuntimeError: boom"),
])
def test_exit_codes_and_the_last_line(tmp_path, capfd, func, code, last):
    log = tmp_path / "run.log"

    def noisy(args):
        print("third-party chatter")
        print("a library warning", file=sys.stderr)
        os.write(2, b"a C-level message\n")
        return func(args)

    assert run_command("sao convert", noisy, argparse.Namespace(), log) == code
    out, err = capfd.readouterr()
    assert "chatter" not in out + err and "library warning" not in out + err and "C-level" not in out + err
    assert all(text in log.read_text() for text in ("third-party chatter", "a library warning", "a C-level message"))
    if last is not None:
        assert err.strip().splitlines()[-1].startswith(last)
    if code == EXIT_INTERNAL_ERROR:
        assert "Traceback" in log.read_text() and f"the traceback is in {log}" in err


@pytest.mark.slow
def test_finding_5_convert_prints_only_its_result_and_verify_failure_exits_1(pristine, tmp_path):
    """A real `sao convert`: nothing but its own lines on the terminal (the FP8GlobalStateManager
    tracebacks and Megatron warnings go to the log); a verify above tolerance exits 1, not 3."""
    out, log = tmp_path / "mcore", tmp_path / "convert.log"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_hf_to_mcore.py"), "--hf", str(pristine),
                           "--out", str(out), "--no-progress", "--log-file", str(log)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout.strip().splitlines()[-1].startswith("hf-to-mcore: ")
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout
    assert "UserWarning" in log.read_text()
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_verify.py"), "--hf", str(pristine),
                           "--mcore", str(out), "--tolerance", "0", "--log-file", str(log)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_CHECK_FAILED, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("verify: FAILED") and proc.stderr == ""


def test_sao_convert_is_registered_on_the_sao_command():
    """`sao convert` cannot silently vanish (an ImportError in the conversion CLI must fail here)."""
    from megatron_sao.cli import build_parser
    from megatron_sao.jobs.convert import run_verify

    args = build_parser().parse_args(["convert", "verify", "--hf", "a", "--mcore", "b"])
    assert args.func is run_verify and args.quiet_log and args.verify_checksums


# ---- guards that no test triggered ----------------------------------------------------------------


def test_export_guards_refuse_extra_missing_and_wrong_shape_tensors(pristine, tmp_path):
    errors = run_distributed(export_with_doctored_manifests, 1, pristine, tmp_path, timeout_s=600)[0]
    assert "export produced tensor 'model.norm.weight', which the source checkpoint did not have" in errors["extra"]
    assert "export did not produce 1 tensors of the source" in errors["missing"]
    assert "'model.layers.0.mlp.gate.extra_weight'" in errors["missing"]
    assert "export produced 'model.norm.weight' with shape [64], the source had [65]" in errors["shape"]
    assert [errors[f"{c}/out_exists"] for c in ("extra", "missing", "shape")] == ["False"] * 3


@pytest.mark.parametrize("position", [0, 2, 4])
def test_dropped_hf_tensor_is_named_first_middle_or_last(position):
    names = [f"t{i}" for i in range(5)]
    infos = {n: TensorInfo(name=n, file="model.safetensors", dtype="F32", shape=(2,), nbytes=8) for n in names}
    spec = LoadSpec(checkpoint=HFCheckpoint(path=Path("/ckpt"), config={}, tensors=infos))
    tasks = [SimpleNamespace(global_param_name=f"p{i}", mapping=SimpleNamespace(hf_param=n), param_weight=None)
             for i, n in enumerate(names) if i != position]
    with pytest.raises(ValueError, match=rf"no Megatron parameter takes 1 HF tensors, e\.g\. \['t{position}'\]"):
        _check_tasks(tasks, [t.global_param_name for t in tasks], spec)


def test_completeness_check_covers_persistent_buffers():
    """float_state (what load_hf_weights fills with NaN and checks) includes persistent floating
    buffers such as the fp32 router expert bias, and nothing a checkpoint does not hold."""

    class Router(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 8))
            self.register_buffer("expert_bias", torch.zeros(4, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(4, dtype=torch.int64))
            self.register_buffer("scratch", torch.zeros(4), persistent=False)

    model = torch.nn.Sequential(Router())
    names = [n for n, _ in float_state([model], ())]
    assert names == ["0.weight", "0.expert_bias"]
    with torch.no_grad():
        for _, tensor in float_state([model], ()):
            tensor.fill_(float("nan"))
        model[0].weight.zero_()  # the "conversion" writes the weight but forgets the bias
    unwritten = [n for n, t in float_state([model], ()) if torch.isnan(t).any()]
    assert unwritten == ["0.expert_bias"]
    assert json.dumps(unwritten)  # names are plain strings, as the error message prints them
