"""Benchmark skip-observation GAE against the per-token reference loop and a memory pass.

    python tools/bench_gae.py                 # paper regime: 128 x 131,072 tokens, 50 turns
    python tools/bench_gae.py --quick         # 32 x 16,384 tokens, 10 turns (seconds)
    python tools/bench_gae.py --device cpu --dtype float32 --repeats 5 --threads 1

For every device (CPU, and CUDA when present unless --device says otherwise) it builds one
synthetic batch, then in the same run times:
- `memory pass`: a clone of the inputs (rewards, values, loss mask), the least any function that
  reads them and writes outputs of their size must do; a sum of them (read only) is printed too;
- `fast`: `megatron_sao.algo.skip_observation_gae`;
- `loop`: `megatron_sao.algo.gae_reference.skip_observation_gae_reference`, the textbook per-token
  loop vectorised over the batch (timed once; --no-loop skips it).
The first two keep the best of --repeats interleaved rounds. It prints seconds, tokens/s, the
fast/loop speed-up, the fast/memory-pass ratio and the largest difference between the two
implementations (relative error is taken on action tokens where the reference is at least 1e-6
of its largest magnitude). Targets: speed-up >= 50x on CPU, fast within 3x of the memory pass,
relative difference <= 1e-6 in float64.

Synthetic batch: row lengths uniform in [T/2, T] (one row of exactly T), a prompt of ~1% of the
row, then `turns` action spans separated by `turns - 1` observation spans of random lengths,
then padding. Terminal reward 0/1 on the last action token (even rows) or on the first padding
token (odd rows, which moves it back to the last action token), a small reward on the first
token of every observation span; lambda is the length-adaptive one (alpha 1.5), gamma 1.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import torch

from megatron_sao.algo.gae import length_adaptive_lambda, skip_observation_gae
from megatron_sao.algo.gae_reference import skip_observation_gae_reference


def synthetic_batch(batch: int, num_tokens: int, turns: int, dtype: torch.dtype, seed: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards, values and loss mask (CPU) of `batch` multi-turn trajectories; see module doc."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.zeros(batch, num_tokens, dtype=dtype)
    values = (0.5 + 0.1 * torch.randn(batch, num_tokens, generator=gen)).to(dtype)
    mask = torch.zeros(batch, num_tokens, dtype=torch.bool)
    num_spans = 2 * turns - 1
    for b in range(batch):
        length = num_tokens if b == 0 else int(torch.randint(num_tokens // 2, num_tokens + 1, (), generator=gen))
        prompt = max(1, length // 100)
        body = length - prompt
        if body < num_spans:
            raise ValueError(f"--tokens {num_tokens} is too short for --turns {turns}")
        weights = torch.rand(num_spans, generator=gen) + 0.05
        spans = 1 + (weights / weights.sum() * (body - num_spans)).floor().long()
        spans[-1] += body - int(spans.sum())
        bounds = (prompt + torch.cumsum(spans, 0)).tolist()
        start = prompt
        for i, end in enumerate(bounds):
            if i % 2 == 0:
                mask[b, start:end] = True
            else:
                rewards[b, start] = 0.1 * float(torch.randn((), generator=gen))
            start = end
        terminal = float(torch.randint(0, 2, (), generator=gen))
        rewards[b, length if (b % 2 and length < num_tokens) else length - 1] += terminal
    return rewards, values, mask


def best_times(fns: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict[str, float]:
    """Best wall time of each function over `repeats` rounds (after one warm-up round).

    Rounds interleave the functions, so a burst of load on a shared machine hits all of them
    rather than one.
    """
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    best = dict.fromkeys(fns, float("inf"))
    for round_index in range(repeats + 1):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if round_index:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def compare(fast: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, max relative difference on significant action tokens)."""
    fast64, ref64 = fast.double(), ref.double()
    abs_err = float((fast64 - ref64).abs().max())
    scale = float(ref64.abs().max())
    significant = mask & (ref64.abs() >= 1e-6 * scale)
    rel = ((fast64 - ref64).abs() / ref64.abs().clamp_min(1e-300))[significant]
    return abs_err, float(rel.max()) if rel.numel() else 0.0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def run(device: torch.device, args: argparse.Namespace) -> bool:
    dtype = getattr(torch, args.dtype)
    rewards, values, mask = synthetic_batch(args.batch, args.tokens, args.turns, dtype, args.seed)
    rewards, values, mask = rewards.to(device), values.to(device), mask.to(device)
    lam = length_adaptive_lambda(mask.sum(1), alpha=1.5)
    num_tokens = args.batch * args.tokens
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{cpu_name()}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}"
    print(f"\n== device {device} ({where})")
    print(f"batch {args.batch} x tokens {args.tokens}, turns {args.turns}, {args.dtype}, "
          f"action tokens {int(mask.sum())} ({float(mask.float().mean()):.1%})")

    times = best_times({
        "clone": lambda: (rewards.clone(), values.clone(), mask.clone()),
        "sum": lambda: (rewards.sum(), values.sum(), mask.sum()),
        "fast": lambda: skip_observation_gae(rewards, values, mask, gamma=1.0, lam=lam),
    }, args.repeats, device)
    t_clone, t_sum, t_fast = times["clone"], times["sum"], times["fast"]
    print(f"memory pass (clone inputs) {t_clone:9.4f} s   {num_tokens / t_clone:12.4g} tokens/s")
    print(f"read pass  (sum inputs)    {t_sum:9.4f} s   {num_tokens / t_sum:12.4g} tokens/s")
    print(f"fast skip_observation_gae  {t_fast:9.4f} s   {num_tokens / t_fast:12.4g} tokens/s")
    print(f"fast / memory pass  {t_fast / t_clone:6.2f}x   (target <= 3x)")
    print(f"fast / read pass    {t_fast / t_sum:6.2f}x")
    if args.no_loop:
        return True

    adv_fast, ret_fast = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=lam)
    start = time.perf_counter()
    adv_ref, ret_ref = skip_observation_gae_reference(rewards, values, mask, gamma=1.0, lam=lam)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_loop = time.perf_counter() - start
    print(f"reference per-token loop   {t_loop:9.4f} s   {num_tokens / t_loop:12.4g} tokens/s")
    target = " (target >= 50x)" if device.type == "cpu" else ""
    print(f"speed-up fast vs loop {t_loop / t_fast:8.1f}x{target}")
    tolerance = 1e-6 if dtype == torch.float64 else 1e-4
    ok = True
    for name, fast, ref in (("advantages", adv_fast, adv_ref), ("returns", ret_fast, ret_ref)):
        abs_err, rel_err = compare(fast, ref, mask)
        ok &= rel_err <= tolerance
        print(f"{name:<10} max |fast - loop| {abs_err:.3e}   max relative {rel_err:.3e}   "
              f"{'OK' if rel_err <= tolerance else 'FAIL'} (<= {tolerance:g})")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128, help="trajectories (paper: 128)")
    parser.add_argument("--tokens", type=int, default=131072, help="tokens per trajectory (paper: 131,072)")
    parser.add_argument("--turns", type=int, default=50, help="action spans per trajectory (paper: <= 50)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CPU, then CUDA when present")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds of the memory pass and the fast GAE (best is kept)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads for every timed function (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-loop", action="store_true", help="skip the slow reference loop")
    parser.add_argument("--quick", action="store_true", help="32 x 16,384 tokens, 10 turns")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.tokens, args.turns = 32, 16384, 10
    if args.batch < 1 or args.tokens < 1 or args.turns < 1 or args.repeats < 1 or args.threads < 0:
        parser.error("--batch, --tokens, --turns and --repeats must be positive, --threads >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")] if args.device in ("auto", "cpu") else []
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device available")
        devices.append(torch.device("cuda"))
    print(f"torch {torch.__version__}, {platform.platform()}, load average {_load()}")
    ok = all([run(device, args) for device in devices])
    print(f"\nload average at the end {_load()} (other processes share these CPUs: compare within a run)")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
