"""Training loads its weights without conversion's fast I/O: importing the training load path (the
trainer, `training.checkpoint`, `load_model_weights`) in a fresh interpreter loads no module of
`megatron_sao.checkpointing.fastio`, nor conversion's own torch_dist reader and writer. (That the
loads themselves, run end to end, import none either is checked by test_checkpoint.py's
`test_load_model_weights_from_every_accepted_path`.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_PROBE = """
import json, sys
import megatron_sao.training.checkpoint
import megatron_sao.training.checkpoint.weights
import megatron_sao.training.trainer
print(json.dumps(sorted(m for m in sys.modules if m.startswith("megatron_sao.checkpointing"))))
"""
CONVERSION_IO = ("megatron_sao.checkpointing.fastio", "megatron_sao.checkpointing.mcore_io",
                 "megatron_sao.checkpointing.dist_reader", "megatron_sao.checkpointing.dist_writer")


def test_the_training_load_path_imports_no_fastio_module():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "megatron_sao.checkpointing.keys" in loaded, loaded  # the probe saw the package's modules
    assert [m for m in loaded if m.startswith(CONVERSION_IO)] == [], loaded
