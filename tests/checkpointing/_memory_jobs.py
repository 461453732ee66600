"""Rank job of the memory-budget test: HF -> mcore -> HF with each conversion's peak RSS measured."""

from __future__ import annotations

from pathlib import Path

from megatron_sao.checkpointing.hf_to_mcore import HfToMcoreRequest, convert_hf_to_mcore
from megatron_sao.checkpointing.mcore_to_hf import McoreToHfRequest, convert_mcore_to_hf
from megatron_sao.checkpointing.model_setup import Layout
from megatron_sao.platform.collective import world_size
from tools.rss import measured


def round_trip_measured(hf: Path, work: Path, bucket_bytes: int, max_shard_bytes: int, fastio: bool) -> dict:
    """Both directions in this rank's process (EP = the number of ranks), each measured on its own:
    the conversion stack is imported first, and freed memory handed back before each baseline."""
    layout = Layout(ep=world_size())
    mcore, out = work / f"mcore_{world_size()}", work / f"hf_{world_size()}"
    up = measured(convert_hf_to_mcore, HfToMcoreRequest(hf_dir=hf, out_dir=mcore, layout=layout, progress=False,
                                                        io_bucket_bytes=bucket_bytes, fastio=fastio), warm_dir=hf)
    down = measured(convert_mcore_to_hf, McoreToHfRequest(mcore_dir=mcore, out_dir=out, layout=layout, progress=False,
                                                          max_shard_bytes=max_shard_bytes, fastio=fastio))
    return {"hf-to-mcore": up, "mcore-to-hf": down, "out": out}
