"""jobs/stages.py, the stages `sao demo` / `online` / `study` share: the conversion stage calls the
converter itself (before: a `sao convert` subprocess whose stdout the demo parsed)."""

from __future__ import annotations

import pytest

from megatron_sao.checkpointing.manifest import MANIFEST_FILE
from megatron_sao.jobs.stages import convert_to_mcore


@pytest.mark.slow  # one conversion on a spawned process: ~35 s on the 2-core box under load
@pytest.mark.timeout(600)
def test_conversion_stage_runs_the_converter_once(tiny_hf_dir, tmp_path, capsys):
    out = tmp_path / "mcore"
    assert convert_to_mcore(tiny_hf_dir, out) == out
    said = capsys.readouterr().out.strip().splitlines()
    assert said[-1].startswith("hf-to-mcore: ") and (out / MANIFEST_FILE).is_file()
    assert convert_to_mcore(tiny_hf_dir, out) == out and capsys.readouterr().out == ""  # complete: skipped
    with pytest.raises(ValueError, match=f"--hf {out} is a Megatron checkpoint"):  # the converter's own check
        convert_to_mcore(out, tmp_path / "again")
