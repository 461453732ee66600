"""Work run on spawned gloo ranks by test_verify_scale: verify and the streamed HF forward on N ranks."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_sao.checkpointing.model_setup import Layout

PROMPT = "The quick brown fox jumps over the lazy dog, twice. " * 2


def verify_job(hf: Path, mcore: Path, import_layout: Layout | None, verify_layouts: list[Layout],
               others: tuple[Path, ...] = ()) -> dict:
    """Collective. Optionally convert `hf` into `mcore` first; then verify in each layout, and run
    the streamed HF forward (recording which units this rank loaded) and, on rank 0, the whole-model
    HF forward it must equal; the same streamed / whole pair for each of `others`."""
    from megatron_sao.checkpointing.hf_streamed import StreamedHFModel
    from megatron_sao.checkpointing.hf_to_mcore import HfToMcoreRequest, convert_hf_to_mcore
    from megatron_sao.checkpointing.verify import VerifyRequest, hf_outputs, prompt_token_ids, verify

    if import_layout is not None:
        convert_hf_to_mcore(HfToMcoreRequest(hf_dir=hf, out_dir=mcore, layout=import_layout, progress=False))
    out: dict = {"verify": {}}
    for layout in verify_layouts:
        result = verify(VerifyRequest(hf_dir=hf, mcore_dir=mcore, layout=layout, prompt=PROMPT))
        out["verify"][layout.describe()] = (result.max_abs, result.mean_abs)
    tokens = prompt_token_ids(hf, PROMPT, 64)
    streamed = StreamedHFModel(hf)
    out["streamed"] = streamed.forward(tokens)
    out["loaded_units"] = streamed.loaded_units
    out["still_materialised"] = [n for n, p in streamed.model.named_parameters() if not p.is_meta]
    if torch.distributed.get_rank() == 0:
        out["whole"] = hf_outputs(hf, tokens)[1]
    out["others"] = {}
    for other in others:  # more families: streamed vs whole only
        streamed_other = StreamedHFModel(other).forward(tokens)
        whole = hf_outputs(other, tokens)[1] if torch.distributed.get_rank() == 0 else None
        out["others"][other.name] = (streamed_other, whole)
    return out

