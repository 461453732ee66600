"""Peak memory of one SAO training step on one long trajectory (tiny recipe, CPU), CP 1 and CP 2.

    python tools/bench_long_context.py [--lengths 2048,4096,8192,16384,32768] [--cp 1,2] [--json OUT]
    python tools/bench_long_context.py --write-trajectories F.parquet [--num 32] [--longest 32768]

Each (length, CP) runs in fresh processes (CP ranks, gloo): the tiny recipe's model
(`recipes/tiny_cpu.yaml`, fp32) with `critic.warmup_steps=0`, so the step is the whole SAO step (a
value forward, K = 2 critic updates, one actor update), and EP 1 (CP ranks only). After a warm-up
step on a short trajectory (optimizer states exist, allocations are warm), each rank resets its
peak RSS (`tools/rss.py`), takes one step on one trajectory of the given length and reports its
peak resident memory and the growth over what it held before the step: the activations and
transients of the step. Printed per length: the growth per rank for each CP, the CP 1 growth over
the 8K one against linear (4x from 8K to 32K), each CP 2 rank's growth over the CP 1 growth, and
the planner's activation term for the same recipe and length (`planning/memory.py`).

`--write-trajectories F` writes a recorded-trajectory file for `sao train recipes/tiny_cpu.yaml
rollout.source=recorded data.trajectories_path=F rollout.max_total_tokens=32768`: `--num`
trajectories of mixed lengths, one of `--longest` tokens, the others 64 to 1024.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
WARMUP_TOKENS = 256


def _overrides(cp: int, length: int) -> list[str]:
    return [f"parallelism.world_size={cp}", f"parallelism.context={cp}", "parallelism.expert=1",
            "critic.warmup_steps=0", f"rollout.max_total_tokens={length}", "logging.param_table=false",
            "logging.wandb_mode=disabled"]


def _trajectory(length: int, seed: int, turns: int = 4, vocab: int = 256):
    """A valid trajectory of exactly `length` tokens: a 16-token prompt, then `turns` turns of an
    action and an observation of equal size (the last turn without observation), random tokens,
    rollout log-probs near log(1 / vocab), a terminal 0/1 reward."""
    import math
    import random

    from megatron_sao.rollout.trajectory import FinishType, RewardKind, Trajectory, TrajectoryStatus

    rng = random.Random(seed)
    traj = Trajectory(prompt_id=f"p{seed}", trajectory_id=f"t{seed}-{length}")
    prompt = min(16, length - 1)
    traj.set_prompt([rng.randrange(vocab) for _ in range(prompt)])
    pieces = 2 * turns - 1
    sizes = [(length - prompt) // pieces] * pieces
    sizes[0] += length - prompt - sum(sizes)
    for i, size in enumerate(sizes):
        if size == 0:
            continue
        tokens = [rng.randrange(vocab) for _ in range(size)]
        if i % 2 == 0:
            traj.append_action(tokens, [-math.log(vocab) + rng.uniform(-0.3, 0.3) for _ in tokens], [0] * size,
                               FinishType.STOP)
        else:
            traj.append_observation(tokens)
    traj.add_reward(float(rng.random() < 0.5), RewardKind.TERMINAL)
    traj.finish(TrajectoryStatus.COMPLETED)
    traj.validate()
    return traj


def measure_rank(cp: int, length: int) -> dict[str, Any]:
    import time

    import rss

    from megatron_sao.config import load_config
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.training.trainer import SaoTrainer

    config = load_config(str(RECIPE), _overrides(cp, length))
    init_model_parallel(config.parallelism, seed=config.run.seed)
    trainer = SaoTrainer(config)
    trainer.train_step([_trajectory(WARMUP_TOKENS, seed=1)])
    traj = _trajectory(length, seed=2)
    timing: dict[str, float] = {}

    def step() -> dict[str, Any]:
        start = time.perf_counter()
        metrics = trainer.train_step([traj])
        timing["step_s"] = time.perf_counter() - start
        return {"tokens": len(traj), "actor_loss": metrics.get("actor/loss")}

    result = rss.measured(step)
    result["growth"] = result["rss_peak"] - result["rss_start"]
    return {**result, **timing}


def planner_activations(length: int, cp: int) -> float:
    """The planner's activation term (bytes) for the tiny recipe at `length` tokens."""
    from megatron_sao.config import load_config
    from megatron_sao.planning import census_from_hf_config, load_hf_config
    from megatron_sao.planning.memory import activation_bytes

    config = load_config(str(RECIPE), _overrides(cp, length))
    return activation_bytes(config, census_from_hf_config(load_hf_config(config.model)), stage=0)


def write_trajectories(path: Path, num: int, longest: int, seed: int) -> None:
    import random

    from megatron_sao.rollout.trajectory_io import write_jsonl, write_parquet

    rng = random.Random(seed)
    lengths = [longest] + [rng.randint(64, 1024) for _ in range(num - 1)]
    rng.shuffle(lengths)
    trajectories = [_trajectory(n, seed=seed + i) for i, n in enumerate(lengths)]
    write = write_parquet if path.suffix == ".parquet" else write_jsonl
    write(path, trajectories)
    print(f"wrote {len(trajectories)} trajectories ({sum(len(t) for t in trajectories)} tokens, longest "
          f"{max(len(t) for t in trajectories)}) to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    parser.add_argument("--cp", default="1,2", help="context-parallel sizes to measure")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    parser.add_argument("--write-trajectories", type=Path, help="write a recorded-trajectory file and exit")
    parser.add_argument("--num", type=int, default=32, help="with --write-trajectories")
    parser.add_argument("--longest", type=int, default=32768, help="with --write-trajectories")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.write_trajectories is not None:
        write_trajectories(args.write_trajectories, args.num, args.longest, args.seed)
        return

    import os

    from megatron_sao.platform import run_distributed

    # A fixed mmap threshold: glibc then serves every tensor above it with its own mapping and
    # returns it on free, so resident memory follows what is allocated (its default threshold
    # rises after the first large free, keeping freed tensors in the heap).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))
    lengths = [int(x) for x in args.lengths.split(",")]
    cps = [int(x) for x in args.cp.split(",")]
    results: dict[str, Any] = {}
    mib = 2**20
    for length in lengths:
        for cp in cps:
            per_rank = run_distributed(measure_rank, cp, cp, length)
            plan = planner_activations(length, cp)
            results[f"{length}/cp{cp}"] = {"per_rank": per_rank, "planner_activations": plan}
            growth = ", ".join(f"{r['growth'] / mib:.0f}" for r in per_rank)
            print(f"{length:6d} tokens CP{cp}: step peak {max(r['rss_peak'] for r in per_rank) / mib:.0f} MiB, growth "
                  f"per rank [{growth}] MiB, planner activations {plan / mib:.0f} MiB, step "
                  f"{max(r['step_s'] for r in per_rank):.1f} s", flush=True)
    print("\nsummary (growth = peak during the step - resident before it, per rank):")
    print(f"{'tokens':>7} " + " ".join(f"{'CP' + str(cp) + ' MiB':>10}" for cp in cps)
          + f" {'planner MiB':>12} {'plan/CP1':>9} {'CP2/CP1':>8}")
    for length in lengths:
        row = {cp: max(r["growth"] for r in results[f"{length}/cp{cp}"]["per_rank"]) for cp in cps}
        plan = results[f"{length}/cp{cps[0]}"]["planner_activations"]
        ratio = f"{row[2] / row[1]:8.2f}" if 1 in row and 2 in row else f"{'-':>8}"
        print(f"{length:7d} " + " ".join(f"{row[cp] / mib:10.0f}" for cp in cps)
              + f" {plan / mib:12.0f} {plan / row[cps[0]]:9.2f} {ratio}")
    if 8192 in lengths and 32768 in lengths and 1 in cps:
        g8 = max(r["growth"] for r in results["8192/cp1"]["per_rank"])
        g32 = max(r["growth"] for r in results["32768/cp1"]["per_rank"])
        print(f"CP1 growth 32K / 8K = {g32 / g8:.2f} (linear: 4.00; {g32 / g8 / 4:.2f}x linear)")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
