"""Work run on spawned gloo ranks (`platform.run_distributed`) by the conversion tests.

One job per pytest session converts every family through every layout, so the ~10 s of
interpreter and import start-up is paid once; each step's failure is recorded (with its
traceback) under its own key, so one broken family does not hide the others' results.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_sao.checkpointing.model_setup import Layout


@dataclass(kw_only=True)
class FamilyCase:
    name: str
    """Result key, e.g. qwen3_moe."""
    hf_dir: Path
    work: Path
    layouts: list[tuple[Layout, Layout]]
    """(import layout, export layout) pairs."""
    verify_layouts: list[Layout] = field(default_factory=lambda: [Layout()])
    critic: bool = False
    """Also: actor -> critic -> HF critic -> critic -> HF critic."""
    training_load: bool = False
    """Also: load the TP2 actor checkpoint with training's builder and loader in TP1 / EP2 / PP2, and
    export a bare dist checkpoint (no manifest, no hf/) with --hf-config."""
    fastio: bool = False
    """Convert on the fast-I/O path (`--fastio`)."""


def layout_name(layout: Layout) -> str:
    return (f"tp{layout.tp}pp{layout.pp}ep{layout.ep}" + (f"etp{layout.etp}" if layout.etp is not None else "")
            + (f"vpp{layout.vpp}" if layout.vpp is not None else "") + (f"cp{layout.cp}" if layout.cp != 1 else ""))


def _step(results: dict[str, Any], key: str, fn, *args) -> Any:
    try:
        results[key] = fn(*args)
    except Exception:
        results[key] = {"error": traceback.format_exc()}
    return results[key]


def _hf_to_mcore(src: Path, out: Path, layout: Layout, fastio: bool, role: str | None = None) -> dict:
    from megatron_sao.checkpointing.hf_to_mcore import HfToMcoreRequest, convert_hf_to_mcore

    return convert_hf_to_mcore(HfToMcoreRequest(hf_dir=src, out_dir=out, layout=layout, role=role, progress=False,
                                                fastio=fastio))


def _mcore_to_hf(src: Path, out: Path, layout: Layout, fastio: bool) -> dict:
    from megatron_sao.checkpointing.mcore_to_hf import McoreToHfRequest, convert_mcore_to_hf

    return convert_mcore_to_hf(McoreToHfRequest(mcore_dir=src, out_dir=out, layout=layout, progress=False,
                                                fastio=fastio))


def _verify(hf: Path, mcore: Path, layout: Layout) -> dict:
    from megatron_sao.checkpointing.verify import VerifyRequest, verify

    result = verify(VerifyRequest(hf_dir=hf, mcore_dir=mcore, layout=layout))
    return {"max_abs": result.max_abs, "mean_abs": result.mean_abs, "role": result.role}


def _training_logits(mcore: Path, layouts: list[Layout]) -> dict:
    """Training's own builder (models.build_model, no conversion overrides) and loader
    (`load_model_weights`, what `actor.load` runs: Megatron's standard dist_checkpointing.load)."""
    import torch

    from megatron_sao.checkpointing.verify import forward_outputs, hf_outputs, prompt_token_ids
    from megatron_sao.config import load_config
    from megatron_sao.models import build_model
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.training.checkpoint import load_model_weights

    tokens = prompt_token_ids(mcore / "hf", "The quick brown fox jumps over the lazy dog, twice. " * 2, 32)
    outputs = {}
    for layout in layouts:
        config = load_config(None, [
            f"model.hf_path={mcore / 'hf'}", "model.load_weights=false", "model.dtype=float32",
            f"parallelism.tensor={layout.tp}", f"parallelism.pipeline={layout.pp}", f"parallelism.expert={layout.ep}",
            "parallelism.world_size=2", "logging.param_table=false"])
        init_model_parallel(config.parallelism, seed=7)
        chunks = build_model(config, role="actor").chunks
        load_model_weights(mcore, "actor", chunks)
        outputs[layout_name(layout)] = forward_outputs(chunks, tokens)
    hf_dir = Path(str(mcore).replace("mcore_", "hf_"))
    reference = hf_outputs(hf_dir, tokens)[1] if torch.distributed.get_rank() == 0 else None
    names = list(outputs)
    return {
        "between_layouts": max((outputs[a] - outputs[b]).abs().max().item() for a in names for b in names),
        "vs_hf": None if reference is None else max((o - reference).abs().max().item() for o in outputs.values()),
    }


def _bare_export(mcore: Path, bare: Path, hf_config: Path, out: Path) -> dict:
    """A dist checkpoint without manifest or hf/ (as other tools write them), exported with --hf-config."""
    import shutil

    import torch

    from megatron_sao.checkpointing.mcore_to_hf import McoreToHfRequest, convert_mcore_to_hf

    if torch.distributed.get_rank() == 0:
        shutil.copytree(mcore, bare, ignore=shutil.ignore_patterns("sao_manifest.json", "hf", "hf_passthrough"))
    torch.distributed.barrier()
    return convert_mcore_to_hf(McoreToHfRequest(mcore_dir=bare, out_dir=out, hf_config_dir=hf_config,
                                                layout=Layout(tp=2), progress=False))


def run_family(case: FamilyCase) -> dict[str, Any]:
    """Collective. Keys: import/<layout>, export/<layout>, verify/<layout>, critic/*, training, and
    fastio_loaded: whether `checkpointing.fastio` was imported in this process by then."""
    results: dict[str, Any] = {}
    io = case.fastio
    for imp, exp in case.layouts:
        mcore = case.work / f"mcore_{layout_name(imp)}"
        hf = case.work / f"hf_{layout_name(imp)}"
        if "error" in _step(results, f"import/{layout_name(imp)}", _hf_to_mcore, case.hf_dir, mcore, imp, io):
            continue
        _step(results, f"export/{layout_name(imp)}", _mcore_to_hf, mcore, hf, exp, io)
    for layout in case.verify_layouts:
        first = case.work / f"mcore_{layout_name(case.layouts[0][0])}"
        _step(results, f"verify/{layout_name(layout)}", _verify, case.hf_dir, first, layout)
    if case.critic:
        c = case.work
        _step(results, "critic/from_actor", _hf_to_mcore, case.hf_dir, c / "critic_mcore_a", Layout(tp=2), io,
              "critic")
        _step(results, "critic/export_a", _mcore_to_hf, c / "critic_mcore_a", c / "critic_hf_a", Layout(pp=2), io)
        _step(results, "critic/reimport", _hf_to_mcore, c / "critic_hf_a", c / "critic_mcore_b", Layout(ep=2), io)
        _step(results, "critic/export_b", _mcore_to_hf, c / "critic_mcore_b", c / "critic_hf_b", Layout(), io)
        _step(results, "critic/verify", _verify, c / "critic_hf_a", c / "critic_mcore_b", Layout(tp=2))
    if case.training_load:
        _step(results, "bare/export", _bare_export, case.work / "mcore_tp1pp1ep1", case.work / "bare_mcore",
              case.hf_dir, case.work / "hf_bare")
        tp2 = case.work / "mcore_tp2pp1ep1"
        _step(results, "training", _training_logits, tp2, [Layout(), Layout(ep=2), Layout(pp=2)])
    results["fastio_loaded"] = "megatron_sao.checkpointing.fastio" in sys.modules
    return results


def run_families(cases: list[FamilyCase]) -> dict[str, dict[str, Any]]:
    """Every case in order (callers put the standard-path cases before the fast-I/O ones)."""
    return {case.name: run_family(case) for case in cases}
