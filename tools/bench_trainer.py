"""Cost of one SAO train step vs one plain forward + backward of the actor on the same tokens.

One SAO step (K critic updates) is: a critic forward (values), K critic forward + backward passes,
one actor forward + backward (log-probs, entropy, DIS), plus the optimizer steps. So it should
cost about (K + 1) forward + backward passes plus a forward, not more; this prints the measured
step, each of those passes measured alone in the same run, the sum they predict, and the ratios.

    .venv/bin/python tools/bench_trainer.py [--batch 16] [--min-len 64] [--max-len 512] [--repeats 5]

CPU, one process (gloo), fp32, a small Qwen3-MoE built on the fly (4 layers, hidden 128,
8 experts top-2), random trajectories of uniformly distributed lengths.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _median_times(fns: dict[str, object], repeats: int) -> dict[str, float]:
    """Median wall time of each function, measured round-robin so that load from other processes
    on the machine falls on all of them alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def bench_rank(hf_dir: str, args: argparse.Namespace) -> dict[str, float]:
    import torch

    from megatron_sao.training.forward_backward import run_forward_backward
    from megatron_sao.training.optim import zero_grads
    from megatron_sao.training.steps import (
        forward_only,
        model_batches,
        model_forward,
        token_loss_forward,
        value_loss_fn,
    )
    from megatron_sao.training.trainer import _packing
    from tests.training.trainer_worker import build_trainer
    from tests.training.trajectories import random_trajectories

    k = args.k
    trainer = build_trainer(hf_dir, [f"critic.updates_per_actor_step={k}", "actor.optim.lr=1e-6",
                                     "critic.optim.lr=1e-6", f"actor.micro_batch_size={args.micro_batch}",
                                     f"critic.micro_batch_size={args.micro_batch}"])
    trajectories = random_trajectories(args.batch, seed=0, lengths=(args.min_len, args.max_len))
    tokens = sum(len(t) for t in trajectories)
    actor_mbs = model_batches(trainer._shard(trajectories, "actor").micro_batches)
    critic_full = trainer._shard(trajectories, "critic").micro_batches
    assert _packing(trainer.config, "actor") == _packing(trainer.config, "critic")

    def plain_actor_fb() -> None:
        zero_grads(trainer.actor)
        run_forward_backward(trainer.actor.chunks, actor_mbs, token_loss_forward,
                             lambda out, mb: (torch.where(mb["label_loss_mask"], out, 0.0).sum(),
                                              mb["label_loss_mask"].sum().to(torch.int), {}))

    def critic_forward() -> None:
        forward_only(trainer.critic, critic_full, lambda out, mb: out)

    for mb in critic_full:
        mb.setdefault("returns", torch.zeros_like(mb["rewards"]))
        mb.setdefault("old_values", torch.zeros_like(mb["rewards"]))
    critic_mbs = model_batches(critic_full)

    def critic_fb() -> None:
        zero_grads(trainer.critic)
        run_forward_backward(trainer.critic.chunks, critic_mbs, model_forward, value_loss_fn(None))

    phases: list[dict[str, float]] = []

    def step() -> None:
        phases.append(trainer.train_step(trajectories))

    t = _median_times({"plain": plain_actor_fb, "critic_forward": critic_forward, "critic_fb": critic_fb,
                       "step": step}, args.repeats)
    t["step_critic"] = statistics.median(m["time/critic_s"] for m in phases[1:])
    t["step_actor"] = statistics.median(m["time/actor_s"] for m in phases[1:])
    return {"tokens": tokens, "k": k, **t}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--k", type=int, default=2, help="critic updates per actor step")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint
    from megatron_sao.platform import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = build_tiny_hf_checkpoint(Path(tmp) / "hf", seed=0, num_hidden_layers=4, hidden_size=128,
                                          num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                          num_experts_per_tok=2, moe_intermediate_size=64)
        r = run_distributed(bench_rank, 1, str(hf_dir), args, timeout_s=3600)[0]
    k, tokens = r["k"], r["tokens"]
    predicted = r["critic_forward"] + k * r["critic_fb"] + r["plain"]
    rows = [
        ("plain actor forward+backward", r["plain"]),
        ("critic forward (values)", r["critic_forward"]),
        ("critic forward+backward", r["critic_fb"]),
        (f"sum: value fwd + {k} critic fb + 1 actor fb", predicted),
        (f"SAO train step (K={k}, measured)", r["step"]),
        ("  of which critic phase (value fwd + K updates)", r["step_critic"]),
        ("  of which actor update", r["step_actor"]),
    ]
    print(f"{tokens} tokens per step ({args.batch} trajectories, lengths {args.min_len}-{args.max_len}), "
          f"median of {args.repeats}")
    for name, seconds in rows:
        print(f"{name:<48} {seconds:8.3f} s   {tokens / seconds:10.0f} tokens/s")
    print(f"SAO step / plain actor fb          {r['step'] / r['plain']:6.2f}x")
    print(f"sum of its passes / plain actor fb {predicted / r['plain']:6.2f}x")
    print(f"SAO step / sum of its passes       {r['step'] / predicted:6.2f}x  (overhead of the step beyond its passes)")


if __name__ == "__main__":
    main()
