"""`utils.atomic`: a file or directory appears complete or not at all, and a failed write leaves the
old one in place with no temporary behind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_sao.utils.atomic import (
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    replace_dir,
    temporary_sibling,
)


@pytest.mark.parametrize("durable", [True, False])
def test_writes_replace_the_file_and_leave_no_temporary(tmp_path: Path, durable: bool):
    path = tmp_path / "state.json"
    atomic_write_text(path, "old\n", durable=durable)
    atomic_write_json(path, {"step": 3}, durable=durable)
    assert json.loads(path.read_text()) == {"step": 3}
    atomic_write_bytes(tmp_path / "blob", b"\x00\x01", durable=durable)
    assert (tmp_path / "blob").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob", "state.json"]


def test_a_failing_writer_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path):
    path = tmp_path / "manifest.json"
    path.write_text("complete")
    with pytest.raises(RuntimeError, match="killed half way"), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed half way")
    assert path.read_text() == "complete" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    with pytest.raises(ValueError):  # NaN is not JSON: refused before anything is written
        atomic_write_json(path, {"loss": math.nan})
    assert path.read_text() == "complete" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_temporaries_are_hidden_siblings_ending_in_tmp(tmp_path: Path):
    tmp = temporary_sibling(tmp_path / "train-00000.parquet")
    assert tmp.parent == tmp_path and tmp.name.startswith(".train-00000.parquet.") and tmp.suffix == ".tmp"
    assert tmp != temporary_sibling(tmp_path / "train-00000.parquet")


@pytest.mark.parametrize("existing", [False, True])
def test_replace_dir_swaps_in_the_staged_directory(tmp_path: Path, existing: bool):
    final, staging = tmp_path / "out", tmp_path / ".out.staging"
    if existing:
        final.mkdir()
        (final / "old.txt").write_text("old")
    staging.mkdir()
    (staging / "sub").mkdir()
    (staging / "sub" / "new.txt").write_text("new")
    replace_dir(staging, final, aside=tmp_path / ".out.old")
    assert (final / "sub" / "new.txt").read_text() == "new" and not (final / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "staging and the old directory are gone"
