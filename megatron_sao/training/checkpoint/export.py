"""A role of a training checkpoint as a HuggingFace checkpoint, by the converter itself.

`export_role_hf` does what `sao convert mcore-to-hf --mcore <iter dir>/<role> --hf-config <model>
--role <role>` does, from the paths `<role>.load` accepts: the checkpoint is resolved as a load
resolves it (`weights.resolve_weights_dir`) and its files checked against their recorded digests
(as a load checks them), then `checkpointing.mcore_to_hf.convert_mcore_to_hf` writes the export on
one spawned process, so its torch.distributed world stays out of the caller's. The converter
writes the weights in the checkpoint's dtype beside the model directory's config.json, tokenizer
and generation config, into a hidden sibling renamed to `out` once complete (an engine can serve
it: `sao demo` starts its engines and its next stages from it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from megatron_sao.training.checkpoint import files
from megatron_sao.training.checkpoint.weights import resolve_weights_dir


def export_role_hf(load: Path, role: Literal["actor", "critic"], hf_config_dir: Path, out: Path) -> dict[str, Any]:
    """`role` of checkpoint `load` (a run's checkpoints directory, an iter_NNNNNNN directory, its role
    directory or a conversion output) as an HF checkpoint at `out`, with the config and tokenizer
    of `hf_config_dir`; the converter's result (its `summary` is the line `sao convert` prints).
    ValueError naming the path for a checkpoint that is no such kind, or whose files changed."""
    from megatron_sao.checkpointing.mcore_to_hf import McoreToHfRequest, convert_mcore_to_hf
    from megatron_sao.platform import run_distributed

    directory, root, table = resolve_weights_dir(Path(load), role)
    if problems := files.verify_files(root, table, sorted(table)):
        raise ValueError(f"{role} checkpoint {load}: " + "; ".join(problems))
    request = McoreToHfRequest(mcore_dir=directory, out_dir=Path(out), hf_config_dir=Path(hf_config_dir), role=role,
                               verify_checksums=False, progress=False)  # verified above, digests of either kind
    return run_distributed(convert_mcore_to_hf, 1, request, timeout_s=float("inf"))[0]
