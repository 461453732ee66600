"""`sao plan RECIPE [overrides] [--gpu G] [--json]`: will this recipe fit, before queueing.

Reads only the model's `config.json` (no weights), the recipe and the GPU spec; prints parameter
counts, per-GPU memory terms, a compute estimate and a verdict. Exit status: 0 fits, 1 does not
fit, 2 config error (impossible layout, missing config.json, unknown GPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DEFAULT_GPU = "h100-80g"


def plan_architecture(hf: dict[str, Any]) -> dict[str, int | None]:
    """The numbers a parallel layout must divide, from a config.json (`load_hf_config`), as the
    parameter census reads them (multi-head latent attention has no query groups)."""
    def first(*keys: str) -> int | None:
        return next((int(hf[k]) for k in keys if hf.get(k)), None)

    heads = int(hf["num_attention_heads"])
    return {"num_layers": int(hf["num_hidden_layers"]), "num_attention_heads": heads,
            "num_query_groups": None if hf.get("kv_lora_rank") else first("num_key_value_heads") or heads,
            "num_experts": first("num_experts", "n_routed_experts", "num_local_experts"),
            "moe_ffn_hidden_size": first("moe_intermediate_size")}


def check_recipe_layout(config: Any, source: str) -> dict[str, Any]:
    """What `sao plan` refuses before it counts anything, and `sao launch slurm` checks before it
    writes a script: a config.json that is malformed or of an architecture the project cannot
    convert or train (the supported families named), a layout the model cannot be split into
    (heads / TP, experts / EP, EP on a dense model, layers / PP), and more GPUs than the nodes have.
    Returns the HF config; ConfigError / ValueError naming the file, field or key."""
    from megatron_sao.checkpointing.families import family_of
    from megatron_sao.config.placement import gpu_layout
    from megatron_sao.config.validate import validate_against_model
    from megatron_sao.planning import load_hf_config

    hf = load_hf_config(config.model)
    where = str(Path(config.model.hf_path) / "config.json") if config.model.hf_path else "the tiny model's config"
    family_of(hf, f"model.hf_path: {where}")
    validate_against_model(config, plan_architecture(hf), source=source)
    gpu_layout(config)
    return hf


def build_plan(recipe: str, overrides: list[str], gpu_name: str | None = None, avg_tokens: int | None = None,
               mfu: float = 0.3) -> tuple[dict[str, Any], str]:
    """(the plan as a dict, its text) for `recipe` + `overrides`; ConfigError / ValueError on user errors."""
    from megatron_sao.config import load_config
    from megatron_sao.planning import census_from_hf_config, gpu_spec, plan_memory
    from megatron_sao.planning.compute import estimate_compute
    from megatron_sao.planning.report import plan_dict, plan_text

    config = load_config(recipe, overrides)
    gpu = gpu_spec(gpu_name or config.launcher.gpu_type or DEFAULT_GPU)
    census = census_from_hf_config(check_recipe_layout(config, source=recipe))
    memory = plan_memory(config, census, gpu)
    compute = estimate_compute(config, census, gpu, memory.layout.trainer_gpus, avg_tokens, mfu)
    return plan_dict(config, census, memory, compute), plan_text(recipe, config, census, memory, compute)


def _cmd_plan(args: argparse.Namespace) -> int:
    from megatron_sao.utils.console import show_output

    result, text = build_plan(args.recipe, args.overrides, args.gpu, args.avg_tokens, args.mfu)
    show_output()
    print(json.dumps(result, indent=2) if args.json else text, flush=True)
    return 0 if result["fits"] else 1


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `sao plan` on the `sao` sub-command parsers."""
    from megatron_sao.planning.gpus import GPUS
    from megatron_sao.utils.args import float_in, int_at_least

    plan = subparsers.add_parser(
        "plan", help="parameter counts, per-GPU memory and a fits / does-not-fit verdict for a recipe",
        description="Plan a recipe before queueing it: parameter counts (total / active, actor / critic, MTP "
                    "apart), per-GPU memory of weights, gradients, optimizer states, activations, engine "
                    "weights and KV cache in the recipe's placement, a compute estimate per step and a "
                    "verdict. Needs only the model's config.json. Refuses (exit 2) a malformed config.json, an "
                    "architecture the project cannot convert or train (the supported families are named), and a "
                    "layout the model or the nodes cannot hold (expert parallelism on a dense model included). "
                    "Exit 0 fits, 1 does not fit, 2 config error. "
                    "The memory model is described in docs/planning.md.",
    )
    plan.add_argument("recipe", help="recipe YAML file (see recipes/)")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. launcher.nnodes=1")
    plan.add_argument("--gpu", choices=sorted(GPUS), default=None,
                      help=f"GPU to plan for (default: the recipe's launcher.gpu_type, else {DEFAULT_GPU})")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.add_argument("--avg-tokens", type=int_at_least(1), default=None,
                      help="assumed mean trajectory length for the compute estimate (default: "
                           "rollout.max_total_tokens / 2)")
    plan.add_argument("--mfu", type=float_in(0.0, 1.0, low_open=True), default=0.3,
                      help="assumed model FLOPs utilisation, in (0, 1] (default 0.3)")
    plan.add_argument("--log-file", help="where third-party output goes (default: a new file in the temp directory); "
                                         "-v keeps it on the terminal")
    plan.set_defaults(func=_cmd_plan, quiet_log="until_started")
    return plan
