"""A plan as one JSON-able dict and as the text `sao plan` prints."""

from __future__ import annotations

from typing import Any

from megatron_sao.config.schema import SaoConfig
from megatron_sao.config.validate import data_parallel_size, expert_tensor_size
from megatron_sao.planning.compute import ComputeEstimate
from megatron_sao.planning.memory import MemoryPlan, micro_batch_tokens
from megatron_sao.planning.params import ModelCensus


def plan_dict(config: SaoConfig, census: ModelCensus, memory: MemoryPlan, compute: ComputeEstimate) -> dict[str, Any]:
    layout = memory.layout
    return {
        "architecture": census.architecture,
        "params_total": census.params_total,
        "params_active": census.params_active,
        "params_mtp": census.params_mtp,
        "params_active_without_embedding": census.params_active_without_embedding,
        "params_active_without_embedding_and_head": census.params_active_without_embedding_and_head,
        "critic_params_total": census.critic_total,
        "critic_params_active": census.critic_active,
        "gpu": memory.gpu.name,
        "gpu_memory_gib": round(memory.gpu.memory_gib, 2),
        "gpus": {"total": layout.total_gpus, "trainer": layout.trainer_gpus, "engine": layout.engine_gpus,
                 "placement": layout.placement},
        "memory_gib_per_gpu": {k: round(v, 3) for k, v in memory.trainer.items()},
        "engine_memory_gib_per_gpu": {k: round(v, 3) for k, v in memory.engine.items()},
        "worst_pipeline_stage": memory.worst_stage,
        "engine_kv_capacity_tokens": memory.engine_kv_capacity_tokens,
        "fits": memory.fits,
        "largest_term": memory.largest_term,
        "problems": memory.problems,
        "compute": {"tokens_per_step": compute.tokens_per_step,
                    "avg_tokens_per_trajectory": compute.avg_tokens_per_trajectory,
                    "step_pflop": round(compute.step_pflop, 1), "mfu": compute.mfu,
                    "step_seconds": round(compute.step_seconds, 1)},
    }


def _b(n: int) -> str:
    return f"{n / 1e9:9.2f} B" if n >= 1e8 else f"{n:>11,}"


def plan_text(recipe: str, config: SaoConfig, census: ModelCensus, memory: MemoryPlan,
              compute: ComputeEstimate) -> str:
    p, layout, gpu = config.parallelism, memory.layout, memory.gpu
    launcher = config.launcher
    role = config.actor
    mb_tokens = micro_batch_tokens(config, role)
    engines = (f"engines {config.rollout.num_engines} x {layout.gpus_per_engine} GPUs ({layout.placement})"
               if layout.engine_gpus else "engines: none on GPUs")
    lines = [
        f"recipe: {recipe} ({census.architecture}, {census.num_layers} layers, "
        f"{census.num_experts} experts top-{census.topk})",
        f"GPUs: {launcher.nnodes} nodes x {launcher.nproc_per_node} {gpu.name} = {layout.total_gpus}; "
        f"trainers {layout.trainer_gpus}; {engines}",
        f"trainer layout: TP {p.tensor} PP {p.pipeline} CP {p.context} EP {p.expert} ETP {expert_tensor_size(config)} "
        f"DP {data_parallel_size(config)}; micro-batch {mb_tokens} tokens; recompute "
        f"{config.model.recompute_granularity}",
        "",
        f"{'parameters':<22}{'total':>13}{'active':>13}",
        f"{'  actor':<22}{_b(census.params_total):>13}{_b(census.params_active):>13}",
        f"{'  critic':<22}{_b(census.critic_total):>13}{_b(census.critic_active):>13}",
        f"{'  mtp (not trained)':<22}{_b(census.params_mtp):>13}",
        "",
        f"memory per trainer GPU (GiB, worst pipeline stage {memory.worst_stage}):",
    ]
    lines += [f"  {k:<22}{v:9.2f}" for k, v in memory.trainer.items() if k != "total"]
    lines.append(f"  {'total':<22}{memory.trainer['total']:9.2f} of {gpu.memory_gib:.1f}")
    if memory.engine:
        lines.append("memory per engine GPU (GiB):")
        lines += [f"  {k:<22}{v:9.2f}" for k, v in memory.engine.items() if k != "total"]
        lines.append(f"  {'total':<22}{memory.engine['total']:9.2f} of {gpu.memory_gib:.1f}")
    if layout.engine_gpus:
        per_traj = config.rollout.max_total_tokens
        lines.append(f"KV cache per engine: {memory.engine_kv_capacity_tokens:,} tokens = "
                     f"{memory.engine_kv_capacity_tokens / per_traj:.1f} full {per_traj}-token trajectories")
    lines += [
        "",
        f"compute per step: {config.data.batch_size * config.algorithm.group_size} trajectories x "
        f"{compute.avg_tokens_per_trajectory} tokens (assumed mean) = {compute.tokens_per_step / 1e6:.1f} M tokens, "
        f"{compute.step_pflop:,.0f} PFLOP, ~{compute.step_seconds:,.0f} s of training at {compute.mfu:.0%} MFU "
        f"on {layout.trainer_gpus} GPUs",
        "",
    ]
    if memory.fits:
        lines.append(f"verdict: fits on {gpu.name} (largest term: {memory.largest_term})")
    else:
        lines.append(f"verdict: does not fit on {gpu.name} (largest term: {memory.largest_term})")
        lines += [f"  - {problem}" for problem in memory.problems]
    return "\n".join(lines)
