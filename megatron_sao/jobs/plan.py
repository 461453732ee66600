"""`sao plan RECIPE [overrides] [--gpu G] [--json]`: will this recipe fit, before queueing.

Reads only the model's `config.json` (no weights), the recipe and the GPU spec; prints parameter
counts, per-GPU memory terms, a compute estimate and a verdict. Exit status: 0 fits, 1 does not
fit, 2 config error (impossible layout, missing config.json, unknown GPU).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

DEFAULT_GPU = "h100-80g"


def build_plan(recipe: str, overrides: list[str], gpu_name: str | None = None, avg_tokens: int | None = None,
               mfu: float = 0.3) -> tuple[dict[str, Any], str]:
    """(the plan as a dict, its text) for `recipe` + `overrides`; ConfigError / ValueError on user errors."""
    from megatron_sao.config import load_config
    from megatron_sao.config.validate import validate_against_model
    from megatron_sao.planning import census_from_hf_config, gpu_spec, load_hf_config, plan_memory
    from megatron_sao.planning.compute import estimate_compute
    from megatron_sao.planning.report import plan_dict, plan_text

    config = load_config(recipe, overrides)
    gpu = gpu_spec(gpu_name or config.launcher.gpu_type or DEFAULT_GPU)
    hf = load_hf_config(config.model)
    census = census_from_hf_config(hf)
    validate_against_model(config, {
        "num_layers": census.num_layers,
        "num_attention_heads": census.num_heads,
        "num_query_groups": census.kv_heads,
        "num_experts": census.num_experts or None,
        "moe_ffn_hidden_size": census.moe_ffn_hidden or None,
    }, source=recipe)
    memory = plan_memory(config, census, gpu)
    compute = estimate_compute(config, census, gpu, memory.layout.trainer_gpus, avg_tokens, mfu)
    return plan_dict(config, census, memory, compute), plan_text(recipe, config, census, memory, compute)


def _cmd_plan(args: argparse.Namespace) -> int:
    import sys

    from megatron_sao.config import ConfigError

    try:
        result, text = build_plan(args.recipe, args.overrides, args.gpu, args.avg_tokens, args.mfu)
    except (ConfigError, ValueError) as e:
        print(f"sao plan: {'config error: ' if isinstance(e, ConfigError) else ''}{e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else text, flush=True)
    return 0 if result["fits"] else 1


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `sao plan` on the `sao` sub-command parsers."""
    from megatron_sao.planning.gpus import GPUS

    plan = subparsers.add_parser(
        "plan", help="parameter counts, per-GPU memory and a fits / does-not-fit verdict for a recipe",
        description="Plan a recipe before queueing it: parameter counts (total / active, actor / critic, MTP "
                    "apart), per-GPU memory of weights, gradients, optimizer states, activations, engine "
                    "weights and KV cache in the recipe's placement, a compute estimate per step and a "
                    "verdict. Needs only the model's config.json. Exit 0 fits, 1 does not fit, 2 config error. "
                    "The memory model is described in docs/planning.md.",
    )
    plan.add_argument("recipe", help="recipe YAML file (see recipes/)")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. launcher.nnodes=1")
    plan.add_argument("--gpu", choices=sorted(GPUS), default=None,
                      help=f"GPU to plan for (default: the recipe's launcher.gpu_type, else {DEFAULT_GPU})")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.add_argument("--avg-tokens", type=int, default=None,
                      help="assumed mean trajectory length for the compute estimate (default: "
                           "rollout.max_total_tokens / 2)")
    plan.add_argument("--mfu", type=float, default=0.3, help="assumed model FLOPs utilisation (default 0.3)")
    plan.set_defaults(func=_cmd_plan)
    return plan
