"""Check (a): SAO train steps (K = 2) of a Qwen3-MoE-shaped model on one GPU, against `sao plan`.

The project's own trainer (`SaoTrainer`) on a process group of one (NCCL), bf16, Megatron's local
layer spec (no Transformer Engine on the machine), random weights (only a config.json is written:
Qwen3-30B-A3B's layer shape, 6 layers, 64 experts top-8, its vocabulary: 2.5 B parameters) and
random trajectories. Three steps; the first warms up, the other two are timed. Figures: step
time, tokens/s, MFU (the planner's FLOPs per step, planning/compute.py, over the measured time and
the GPU's dense bf16 peak), peak CUDA memory against `sao plan`'s per-GPU total for the same
recipe. PASS: every step finite, the actor and the critic updated.

    python tools/gpu_check/sao_step.py          # on the GPU (tools/gpu_check.sh)
    python tools/gpu_check/sao_step.py --dry    # CPU, tiny shapes, gloo: the same code path
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import gib, quiet_libraries, report

LABEL = "(a)"

# Qwen3-30B-A3B's layer (hidden 2048, 32 heads of 128, 4 KV heads, 128-wide experts of 768) with
# 6 layers and 64 experts: 2.5 B parameters, 0.96 B active.
H200_MODEL = dict(hidden_size=2048, num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                  vocab_size=151936, max_position_embeddings=8192)
H200_BATCH = dict(trajectories=16, tokens=2048, micro_batch=4)
DRY_MODEL: dict[str, int] = {}  # the tiny Qwen3-MoE of models/tiny_hf.py
DRY_BATCH = dict(trajectories=4, tokens=96, micro_batch=2)


def write_model(directory: Path, dims: dict[str, int]) -> Path:
    """A config.json (no weights: the trainer initialises them, model.load_weights=false)."""
    from megatron_sao.models.tiny_hf import tiny_hf_config

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_hf_config("qwen3_moe", **dims).to_dict()))
    return directory


def write_recipe(path: Path, hf_dir: Path, batch: dict[str, int], gpu: bool) -> Path:
    import yaml

    recipe = {
        "run": {"name": "gpu_check", "output_dir": str(path.parent / "runs"), "total_steps": 3},
        "model": {"hf_path": str(hf_dir), "load_weights": False, "dtype": "bfloat16" if gpu else "float32"},
        "parallelism": {"tensor": 1, "pipeline": 1, "expert": 1, "world_size": 1},
        "actor": {"micro_batch_size": batch["micro_batch"], "optim": {"lr": 1e-6}},
        "critic": {"micro_batch_size": batch["micro_batch"], "updates_per_actor_step": 2, "warmup_steps": 0,
                   "optim": {"lr": 1e-6}},
        "data": {"batch_size": batch["trajectories"], "trajectories_path": "unused.parquet"},  # data in-process
        "rollout": {"engine": "cpu", "source": "recorded", "max_total_tokens": batch["tokens"],
                    "max_new_tokens_per_turn": batch["tokens"] // 2, "environment": "calc", "reward": "math"},
        "logging": {"wandb_mode": "disabled", "param_table": False},
        "launcher": {"kind": "local", "nnodes": 1, "nproc_per_node": 1, "gpu_type": "h200-141g"},
    }
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def trajectories(num: int, tokens: int, vocab: int, seed: int = 0) -> list:
    """`num` trajectories of exactly `tokens` tokens: a prompt, then action / observation turns;
    rollout log-probs near log(1/vocab), a 0/1 terminal reward."""
    from megatron_sao.rollout.trajectory import FinishType, RewardKind, Trajectory, TrajectoryStatus

    rng = random.Random(seed)
    out = []
    for i in range(num):
        traj = Trajectory(prompt_id=f"p{i}", trajectory_id=f"t{i}")
        traj.set_prompt([rng.randrange(vocab) for _ in range(tokens // 8)])
        turns = 3
        for turn in range(turns):
            left = tokens - len(traj.token_ids)
            act = left if turn == turns - 1 else left // (2 * (turns - turn))
            traj.append_action([rng.randrange(vocab) for _ in range(act)],
                               [-math.log(vocab) + rng.uniform(-0.2, 0.2) for _ in range(act)], [0] * act,
                               FinishType.STOP)
            if turn < turns - 1:
                traj.append_observation([rng.randrange(vocab) for _ in range((tokens - len(traj.token_ids)) // 4)])
        traj.add_reward(float(rng.random() < 0.5), RewardKind.TERMINAL)
        traj.finish(TrajectoryStatus.COMPLETED)
        out.append(traj)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes, gloo")
    args = parser.parse_args()
    quiet_libraries()
    import torch

    gpu = not args.dry
    if gpu and not torch.cuda.is_available():
        return report("sao_step", LABEL, False, "no CUDA device", {})
    model_dims, batch = (H200_MODEL, H200_BATCH) if gpu else (DRY_MODEL, DRY_BATCH)

    from megatron_sao.config import load_config
    from megatron_sao.jobs.plan import build_plan
    from megatron_sao.planning import census_from_hf_config, gpu_spec, load_hf_config
    from megatron_sao.planning.compute import estimate_compute
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.training.trainer import SaoTrainer

    work = Path(tempfile.mkdtemp(prefix="gpu_check_a_"))
    recipe = write_recipe(work / "recipe.yaml", write_model(work / "hf", model_dims), batch, gpu)
    plan, plan_text = build_plan(str(recipe), [])
    config = load_config(recipe, [])
    census = census_from_hf_config(load_hf_config(config.model))

    init_model_parallel(config.parallelism, seed=0)
    built = time.perf_counter()
    trainer = SaoTrainer(config, mode="rl")
    build_s = time.perf_counter() - built
    data = trajectories(batch["trajectories"], batch["tokens"], census.vocab_size)
    tokens = sum(len(t) for t in data)
    steps = []
    for _ in range(3):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = trainer.train_step(data)
        if gpu:
            torch.cuda.synchronize()
        steps.append((time.perf_counter() - start, metrics))
    step_s = statistics.median(s for s, _ in steps[1:])
    last = steps[-1][1]
    finite = all(math.isfinite(m.get(k, float("nan"))) for _, m in steps for k in ("actor/loss", "critic/value_loss"))
    trained = trainer.state.actor_optimizer_steps == 3 and trainer.state.critic_optimizer_steps == 6
    compute = estimate_compute(config, census, gpu_spec("h200-141g"), 1, avg_tokens=batch["tokens"])
    mfu = compute.step_pflop * 1e15 / (step_s * gpu_spec("h200-141g").bf16_tflops * 1e12)
    peak = gib(torch.cuda.max_memory_allocated()) if gpu else float("nan")
    reserved = gib(torch.cuda.max_memory_reserved()) if gpu else float("nan")
    planned = plan["memory_gib_per_gpu"]["total"]
    figures = {
        "params_total": census.params_total, "params_active": census.params_active, "tokens_per_step": tokens,
        "build_s": build_s, "step_s": [s for s, _ in steps], "step_s_median_timed": step_s,
        "tokens_per_s": tokens / step_s, "step_pflop_planner": compute.step_pflop, "mfu": mfu,
        "peak_allocated_gib": peak, "peak_reserved_gib": reserved, "plan_gib": planned,
        "plan_terms_gib": plan["memory_gib_per_gpu"], "plan_text": plan_text.splitlines(), "metrics_last": last,
    }
    losses = {k: last.get(k, float("nan")) for k in ("actor/loss", "critic/value_loss")}
    line = (f"{census.params_total / 1e9:.2f} B params ({census.params_active / 1e9:.2f} B active), "
            f"{tokens} tokens/step, step {step_s:.2f} s, {tokens / step_s:,.0f} tokens/s, MFU {mfu:.1%} (planner "
            f"FLOPs, {gpu_spec('h200-141g').bf16_tflops:.0f} TFLOP/s peak); peak CUDA memory {peak:.1f} GiB "
            f"allocated / {reserved:.1f} reserved vs sao plan {planned:.1f} GiB; actor loss "
            f"{losses['actor/loss']:.4g}, value loss {losses['critic/value_loss']:.4g}")
    if not (finite and trained):
        line += f" [finite={finite}, actor/critic optimizer steps {trainer.state.actor_optimizer_steps}/" \
                f"{trainer.state.critic_optimizer_steps}, expected 3/6]"
    return report("sao_step", LABEL, finite and trained, line, figures, dry=args.dry)


if __name__ == "__main__":
    raise SystemExit(main())
