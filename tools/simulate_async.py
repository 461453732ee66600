"""Discrete-event simulation of async SAO vs synchronous training, to size the rollout / training split.

    python tools/simulate_async.py                          # GLM-5-class 744B-A40B on 256 H200s
    python tools/simulate_async.py --gpus 640               # the shipped recipe's 80 nodes
    python tools/simulate_async.py --recipe recipes/glm5_744b_a40b_swe_sao.yaml   # FLOPs from the planner
    python tools/simulate_async.py --from-bench bench.json  # replay tools/bench_async.py's measured costs

Pure Python (no torch) unless `--recipe` asks the planner. The model:
- a trajectory needs L generated tokens, L ~ lognormal(median, sigma) clamped to `--len-max` (or
  resampled from measured lengths); it trains on L / `--gen-frac` tokens (observations included);
- an engine decodes all its running trajectories together (continuous batching): one step takes
  `base + per_seq x running` seconds and gives each of them one token; at most `max_inflight`
  run on an engine, new ones go to the least loaded engine;
- a training step on B trajectories takes `fixed + per_token x tokens`, then the weight sync pauses
  every engine for `sync` seconds (partial rollout: in-flight trajectories continue afterwards);
- async (SAO): prompts start whenever an engine slot is free and the buffer holds fewer than
  `max_buffered` (2 x B; in-flight ones do not count, as in the pipeline); the trainer takes the B
  oldest ready trajectories, dropping those more than `max_staleness` versions old (token check:
  the first token decides; trajectory check: the last);
- sync (barrier): a round of B trajectories starts when the trainer asks for a batch; it trains
  when the last one finishes; nothing generates while it trains and syncs (group size does not
  change the timing: the batch barrier contains the group barrier);
- colocated sync: every GPU serves as an engine during the round and as a trainer during the step,
  plus `--switch-s` per step to offload / reload.
Measured after `--warmup-steps`: trajectories trained per second, trainer idle fraction, engine
idle fraction (paused or empty), occupancy (running / max_inflight), staleness p50 / p99 of what
was trained, dropped share. Not modelled: prefill, tool latency, stragglers inside the trainer,
network contention of the sync, failures.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import math
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GLM5 = {"actor_params": 743.91e9, "critic_params": 742.96e9, "active_params": 41.78e9, "critic_active": 40.83e9}
"""GLM-5-class parameter counts as `sao plan recipes/glm5_744b_a40b_swe_sao.yaml` measures them."""


@dataclass(kw_only=True, slots=True)
class Lengths:
    median: float
    sigma: float
    max_tokens: int
    gen_frac: float = 1.0
    """Generated tokens / trained tokens of a trajectory."""
    samples: tuple[int, ...] = ()
    """Measured lengths to resample instead of the lognormal."""

    def draw(self, rng: random.Random) -> int:
        if self.samples:
            return rng.choice(self.samples)
        return min(self.max_tokens, max(1, round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))))


@dataclass(kw_only=True, slots=True)
class EngineCost:
    base_s: float
    per_seq_s: float
    max_inflight: int

    def step_s(self, running: int) -> float:
        return self.base_s + self.per_seq_s * running


@dataclass(kw_only=True, slots=True)
class TrainCost:
    fixed_s: float
    per_token_s: float
    sync_s: float


@dataclass(kw_only=True, slots=True)
class Scenario:
    barrier: bool
    batch: int
    engines: int
    max_staleness: int = 4
    staleness_check: str = "token"
    """`token`: a trajectory is as old as its first token; `trajectory`: as its last one."""
    max_buffered: int = 0
    """Async back-pressure; 0: 2 x batch."""
    max_in_flight: int = 0
    """Trajectories generating at once over all engines; 0: engines x max_inflight."""
    steps: int = 100
    warmup_steps: int = 10
    seed: int = 0


@dataclass(slots=True)
class Result:
    trained_per_s: float = 0.0
    trained_tokens_per_s: float = 0.0
    """Trained tokens (observations included) per second: unlike trajectories/s, not inflated by
    training only the short ones when the long ones go stale."""
    length_bias: float = 1.0
    """Mean generated length of the trained trajectories / of every finished one (< 1: the tail
    is dropped more often than the rest)."""
    trainer_idle_frac: float = 0.0
    engine_idle_frac: float = 0.0
    occupancy: float = 0.0
    staleness_p50: float = 0.0
    staleness_p99: float = 0.0
    dropped_frac: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    """Whole run: started, completed, trained, dropped, buffered, in_flight."""


@dataclass(slots=True)
class _Engine:
    vt: float = 0.0  # tokens each running trajectory has received so far
    running: list[tuple[float, int]] = field(default_factory=list)  # heap of (vt at which it ends, id)


def simulate(sc: Scenario, lengths: Lengths, engine: EngineCost, train: TrainCost) -> Result:
    """Run `sc.warmup_steps + sc.steps` training steps; statistics cover the last `sc.steps`."""
    if sc.staleness_check not in ("token", "trajectory"):
        raise ValueError(f"staleness_check must be 'token' or 'trajectory', got {sc.staleness_check!r}")
    if sc.engines < 1 or sc.batch < 1:
        raise ValueError("a scenario needs at least one engine and a batch of at least one trajectory")
    rng = random.Random(sc.seed)
    max_buffered = sc.max_buffered or 2 * sc.batch
    engines = [_Engine() for _ in range(sc.engines)]
    version_of: dict[int, int] = {}  # the version its staleness is measured from
    length_of: dict[int, int] = {}
    buffer: collections.deque[int] = collections.deque()
    counts = collections.Counter()
    version = engine_version = 0
    now, state, until = 0.0, "idle", math.inf
    paused, round_open, to_start = False, False, 0
    steps_done, window_start, window_trained, window_tokens = 0, 0.0, 0, 0.0
    trained_len, finished_len = [0, 0], [0, 0]  # (sum of generated tokens, count) in the window
    busy = {"trainer": 0.0, "engines": 0.0, "running": 0.0}
    staleness: list[int] = []
    dropped_at_window = 0

    def start_one() -> bool:
        e = min(engines, key=lambda x: len(x.running))
        if len(e.running) >= engine.max_inflight:
            return False
        if sc.max_in_flight and sum(len(x.running) for x in engines) >= sc.max_in_flight:
            return False
        tid = counts["started"]
        counts["started"] += 1
        length_of[tid] = lengths.draw(rng)
        version_of[tid] = engine_version
        heapq.heappush(e.running, (e.vt + length_of[tid], tid))
        return True

    while steps_done < sc.warmup_steps + sc.steps:
        if state == "idle" and not sc.barrier:  # the actor only gets newer: stale stays stale
            fresh = collections.deque(t for t in buffer if version - version_of[t] <= sc.max_staleness)
            counts["dropped"] += len(buffer) - len(fresh)
            buffer = fresh
        if state == "idle" and sc.barrier and not round_open:  # the trainer asks: a round starts
            round_open, to_start = True, sc.batch
        if sc.barrier:
            while to_start and start_one():
                to_start -= 1
        else:
            while len(buffer) < max_buffered and start_one():
                pass
        if state == "idle" and len(buffer) >= sc.batch:
            batch = [buffer.popleft() for _ in range(sc.batch)]
            round_open = False
            staleness += [version - version_of[t] for t in batch] if steps_done >= sc.warmup_steps else []
            tokens = sum(length_of[t] for t in batch) / lengths.gen_frac
            state, until = "train", now + train.fixed_s + train.per_token_s * tokens
            counts["trained"] += len(batch)
            if steps_done >= sc.warmup_steps:
                window_trained += len(batch)
                window_tokens += tokens
                trained_len[0] += sum(length_of[t] for t in batch)
                trained_len[1] += len(batch)
        next_done = math.inf
        if not paused:
            for e in engines:
                if e.running:
                    next_done = min(next_done, now + (e.running[0][0] - e.vt) * engine.step_s(len(e.running)))
        t_next = min(next_done, until)
        assert t_next < math.inf, "nothing can happen: the scenario deadlocks"
        dt = t_next - now
        if steps_done >= sc.warmup_steps:
            busy["trainer"] += dt if state != "idle" else 0.0
            for e in engines:
                busy["engines"] += dt if e.running and not paused else 0.0
                busy["running"] += dt * len(e.running)
        for e in engines:
            if e.running and not paused:
                e.vt += dt / engine.step_s(len(e.running))
        now = t_next
        for e in engines:
            while e.running and e.running[0][0] <= e.vt + 1e-9:
                tid = heapq.heappop(e.running)[1]
                buffer.append(tid)
                counts["completed"] += 1
                if steps_done >= sc.warmup_steps:
                    finished_len[0] += length_of[tid]
                    finished_len[1] += 1
                if sc.staleness_check == "trajectory":
                    version_of[tid] = engine_version
        if now >= until:
            if state == "train":
                version += 1
                state, until, paused = "sync", now + train.sync_s, True
            else:
                engine_version, paused = version, False
                state, until = "idle", math.inf
                steps_done += 1
                if steps_done == sc.warmup_steps:
                    window_start, dropped_at_window = now, counts["dropped"]
    window = now - window_start
    counts["buffered"] = len(buffer)
    counts["in_flight"] = sum(len(e.running) for e in engines)
    dropped = counts["dropped"] - dropped_at_window
    return Result(
        trained_per_s=window_trained / window, trained_tokens_per_s=window_tokens / window,
        length_bias=(trained_len[0] / max(1, trained_len[1])) / max(1e-9, finished_len[0] / max(1, finished_len[1])),
        trainer_idle_frac=1 - busy["trainer"] / window,
        engine_idle_frac=1 - busy["engines"] / (window * sc.engines),
        occupancy=busy["running"] / (window * sc.engines * engine.max_inflight),
        staleness_p50=_percentile(staleness, 0.5), staleness_p99=_percentile(staleness, 0.99),
        dropped_frac=dropped / max(1, dropped + window_trained), counts=dict(counts))


def _percentile(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


# ---- deployments -------------------------------------------------------------------------------


def train_flops_per_token(params: dict[str, float], critic: bool, updates: int = 2, recompute: bool = True) -> float:
    """Matmul FLOPs per trained token, as `planning/compute.py` counts them without attention: a
    forward is 2 x active params, an update 3 forwards (4 with full recompute); SAO adds a critic
    value forward and K critic updates, GRPO (ppo_clip) an actor forward for the old log-probs."""
    passes = 4 if recompute else 3
    actor = 2 * params["active_params"]
    if critic:
        return actor * passes + 2 * params["critic_active"] * (1 + passes * updates)
    return actor * (passes + 1)


def planner_flops_per_token(recipe: str, mean_tokens: int, gpu: str | None) -> tuple[float, float]:
    """(SAO, GRPO) FLOPs per trained token from `sao plan`'s compute estimate (attention included)."""
    from megatron_sao.jobs.plan import build_plan

    grpo = ["algorithm.advantage=grpo", "algorithm.policy_loss=ppo_clip", "algorithm.old_logprobs=recompute",
            "algorithm.group_size=8", "data.batch_size=16"]
    out = []
    for overrides in ([], grpo):
        compute = build_plan(recipe, overrides, gpu, mean_tokens, 0.3)[0]["compute"]
        out.append(compute["step_pflop"] * 1e15 / compute["tokens_per_step"])
    return out[0], out[1]


def min_trainer_gpus(params: dict[str, float], critic: bool, gpu_gb: float, usable: float, per_node: int) -> int:
    """A lower bound on trainer GPUs from training state alone: 18 bytes per parameter (bf16 weight,
    fp32 grad, fp32 master, Adam m and v) of the actor (and critic), in `usable` of each GPU."""
    total = params["actor_params"] + (params["critic_params"] if critic else 0.0)
    gpus = math.ceil(18 * total / (gpu_gb * 1e9 * usable))
    return per_node * math.ceil(gpus / per_node)


def mean_length(lengths: Lengths, rng_seed: int = 0, n: int = 20000) -> float:
    rng = random.Random(rng_seed)
    return statistics.fmean(lengths.draw(rng) for _ in range(n))


def sweep(args: argparse.Namespace) -> None:
    lengths = Lengths(median=args.len_median, sigma=args.len_sigma, max_tokens=args.len_max, gen_frac=args.gen_frac)
    mean_train_tokens = mean_length(lengths) / lengths.gen_frac
    if args.recipe:
        flops = dict(zip(("sao", "grpo"), planner_flops_per_token(args.recipe, int(mean_train_tokens), args.gpu_name),
                         strict=True))
        source = f"planner ({args.recipe}, attention at {mean_train_tokens:.0f} tokens)"
    else:
        flops = {"sao": train_flops_per_token(GLM5, critic=True), "grpo": train_flops_per_token(GLM5, critic=False)}
        source = "6N-style count of GLM-5-class active params (no attention)"
    floor = {"sao": min_trainer_gpus(GLM5, True, args.gpu_gb, args.usable_memory, args.gpus_per_node),
             "grpo": min_trainer_gpus(GLM5, False, args.gpu_gb, args.usable_memory, args.gpus_per_node)}
    engine = EngineCost(base_s=args.decode_base_ms / 1e3, per_seq_s=args.decode_per_seq_ms / 1e3,
                        max_inflight=args.max_inflight)

    def train(algo: str, gpus: int, switch_s: float = 0.0) -> TrainCost:
        per_token = flops[algo] / (gpus * args.gpu_tflops * 1e12 * args.mfu)
        return TrainCost(fixed_s=args.train_fixed_s, per_token_s=per_token, sync_s=args.sync_s + switch_s)

    def run(barrier: bool, engines: int, cost: TrainCost) -> Result:
        sc = Scenario(barrier=barrier, batch=args.batch, engines=engines, max_staleness=args.max_staleness,
                      staleness_check=args.staleness_check, max_in_flight=args.max_inflight_total,
                      steps=args.steps, warmup_steps=args.warmup_steps, seed=args.seed)
        return simulate(sc, lengths, engine, cost)

    print(f"{args.gpus} GPUs ({args.gpu_tflops:g} TFLOP/s bf16, MFU {args.mfu:g}); engines of {args.engine_gpus} GPUs: "
          f"step {args.decode_base_ms:g} ms + {args.decode_per_seq_ms:g} ms x running, <= {args.max_inflight} each; "
          f"batch {args.batch}; lengths lognormal(median {args.len_median:g}, sigma {args.len_sigma:g}) <= "
          f"{args.len_max} generated tokens, {mean_train_tokens:.0f} trained tokens per trajectory on average; "
          f"train FLOPs/token: SAO {flops['sao'] / 1e9:.0f} G, GRPO {flops['grpo'] / 1e9:.0f} G ({source}); "
          f"weight sync {args.sync_s:g} s; in flight <= {args.max_inflight_total or 'engines x per engine'}; "
          f"staleness <= {args.max_staleness} ({args.staleness_check}); "
          f"min trainer GPUs (state memory): SAO {floor['sao']}, GRPO {floor['grpo']}")
    print(f"{'engine':>6}{'trainer':>8} |{'traj/s':>7}{'ktok/s':>7}{'trn idle':>9}{'eng idle':>9}{'stale p99':>10}"
          f"{'drop':>6}{'len bias':>9} |{'traj/s':>7}{'ktok/s':>7}{'trn idle':>9}{'eng idle':>9} |{'traj/s':>7}")
    print(f"{'GPUs':>6}{'GPUs':>8} |{'async SAO':^57}|{'sync GRPO (disaggregated)':^32}|{'sync 1':>7}")
    best: dict[str, tuple[float, int, Result]] = {}
    num_engines = range(1, args.gpus // args.engine_gpus)
    every = max(1, math.ceil(len(num_engines) / args.max_rows))
    for n in num_engines[::every]:
        rollout_gpus = n * args.engine_gpus
        trainer_gpus = args.gpus - rollout_gpus
        row = {"sao": (run(False, n, train("sao", trainer_gpus)), trainer_gpus >= floor["sao"]),
               "grpo": (run(True, n, train("grpo", trainer_gpus)), trainer_gpus >= floor["grpo"]),
               "single": (run(True, n, train("sao", trainer_gpus)), trainer_gpus >= floor["sao"])}
        for name, (r, fits) in row.items():
            if fits and r.trained_tokens_per_s > best.get(name, (0.0,))[0]:
                best[name] = (r.trained_tokens_per_s, rollout_gpus, r)
        sao, grpo = row["sao"][0], row["grpo"][0]
        print(f"{rollout_gpus:>6}{trainer_gpus:>8} |{_rates(*row['sao'])}{sao.trainer_idle_frac:>9.0%}"
              f"{sao.engine_idle_frac:>9.0%}{sao.staleness_p99:>10.0f}{sao.dropped_frac:>6.0%}{sao.length_bias:>9.2f} |"
              f"{_rates(*row['grpo'])}{grpo.trainer_idle_frac:>9.0%}{grpo.engine_idle_frac:>9.0%} |"
              f"{_rates(*row['single'])[:7]}")
    colocated = run(True, args.gpus // args.engine_gpus, train("grpo", args.gpus, args.switch_s))
    print(f"colocated sync GRPO (all {args.gpus} GPUs generate, then all train, +{args.switch_s:g} s switch per step): "
          f"{colocated.trained_per_s:.3f} traj/s, {colocated.trained_tokens_per_s / 1e3:.1f} ktok/s, engines idle "
          f"{colocated.engine_idle_frac:.0%}")
    names = {"sao": "async SAO", "grpo": "sync GRPO (disaggregated)", "single": "sync single-rollout"}
    for name, (value, rollout_gpus, r) in best.items():
        print(f"best split (trained tokens/s) for {names[name]}: {rollout_gpus} engine GPUs + "
              f"{args.gpus - rollout_gpus} trainer GPUs: {r.trained_per_s:.3f} traj/s, {value / 1e3:.1f} ktok/s, "
              f"trainer idle {r.trainer_idle_frac:.0%}, engines idle {r.engine_idle_frac:.0%}, staleness p50/p99 "
              f"{r.staleness_p50:.0f}/{r.staleness_p99:.0f}, dropped {r.dropped_frac:.0%}")
    if "sao" in best and "grpo" in best:
        sao, grpo = best["sao"][2], best["grpo"][2]
        print(f"async SAO / sync GRPO, each at its best split: trained tokens/s "
              f"x{sao.trained_tokens_per_s / grpo.trained_tokens_per_s:.2f}, trajectories/s "
              f"x{sao.trained_per_s / grpo.trained_per_s:.2f}; vs colocated sync GRPO: tokens/s "
              f"x{sao.trained_tokens_per_s / colocated.trained_tokens_per_s:.2f}")


def _rates(r: Result, fits: bool) -> str:
    return f"{r.trained_per_s:>7.3f}{r.trained_tokens_per_s / 1e3:>7.1f}" if fits else f"{'(mem)':>7}{'':>7}"


# ---- replaying the benchmark -------------------------------------------------------------------


def bench_models(data: dict[str, Any]) -> tuple[Lengths, dict[str, EngineCost], dict[str, TrainCost]]:
    """Costs measured by tools/bench_async.py: resampled generated lengths and their share of
    trained tokens; per mode, the engine step time fitted on that mode's samples (on a shared box
    the engine is slower while the trainer computes beside it) and the train cost."""
    results, args = data["results"], data["args"]
    trajectories = [t for r in results.values() for t in r["trajectories"]]
    lengths = Lengths(median=0, sigma=0, max_tokens=0, samples=tuple(max(1, t["action_tokens"]) for t in trajectories),
                      gen_frac=sum(t["action_tokens"] for t in trajectories) / sum(t["tokens"] for t in trajectories))
    pooled = [tuple(p) for r in results.values() for p in r["engine"].get("decode_points", [])]
    engine, train = {}, {}
    for mode, r in results.items():
        points = [tuple(p) for p in r["engine"].get("decode_points", [])]
        base, per_seq = _fit(points if len(points) >= 2 else pooled)
        engine[mode] = EngineCost(base_s=base, per_seq_s=per_seq, max_inflight=int(args["inflight"]))
        steps = r["steps"]
        tokens = sum(s["tokens"] for s in steps)
        train[mode] = TrainCost(fixed_s=0.0, per_token_s=sum(s["train_s"] for s in steps) / tokens,
                                sync_s=statistics.fmean(s["sync_s"] for s in steps))
    return lengths, engine, train


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        return my, 0.0
    if my - slope * mx < 0:  # a negative base is unphysical: proportional fit
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x in xs)
    return my - slope * mx, slope


def replay(args: argparse.Namespace) -> None:
    data = json.loads(Path(args.from_bench).read_text())
    lengths, engine, train = bench_models(data)
    if args.replay_engine and args.replay_engine not in engine:
        raise ValueError(f"--replay-engine {args.replay_engine!r}: the bench file has modes {sorted(engine)}")
    bench_args, results = data["args"], data["results"]
    print(f"replaying {args.from_bench}: {len(lengths.samples)} measured lengths, generated share "
          f"{lengths.gen_frac:.2f}; m = measured, s = simulated")
    print(f"{'mode':<13}{'engine step (fit)':>22}{'traj/s m/s':>13}{'trn idle m/s':>14}{'eng idle m/s':>14}"
          f"{'stale p99 m/s':>15}")
    for mode, r in results.items():
        sc = Scenario(barrier=mode != "sao", batch=int(bench_args["batch"]), engines=1,
                      max_staleness=int(bench_args["max_staleness"]), steps=args.steps, warmup_steps=args.warmup_steps,
                      seed=args.seed)
        cost = engine[args.replay_engine or mode]
        sim = simulate(sc, lengths, cost, train[mode])
        fit = f"{cost.base_s * 1e3:.1f} + {cost.per_seq_s * 1e3:.2f} x n ms"
        print(f"{mode:<13}{fit:>22}{r['trained_per_s']:>7.2f}/{sim.trained_per_s:<5.2f}"
              f"{r['trainer_idle_frac']:>8.0%}/{sim.trainer_idle_frac:<5.0%}"
              f"{r['engine'].get('idle_frac', float('nan')):>8.0%}/{sim.engine_idle_frac:<5.0%}"
              f"{r['staleness_p99']:>9.0f}/{sim.staleness_p99:<5.0f}")


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from-bench", default=None, help="JSON written by tools/bench_async.py --json: replay it")
    p.add_argument("--replay-engine", default=None,
                   help="with --from-bench: every mode uses this mode's engine fit (e.g. sync_grpo: the engine "
                        "as fast as when it had the CPU to itself)")
    p.add_argument("--recipe", default=None, help="take training FLOPs per token from `sao plan` on this recipe")
    p.add_argument("--gpu-name", default=None, help="the planner's GPU (default: the recipe's)")
    p.add_argument("--gpus", type=int, default=256)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 peak (H200)")
    p.add_argument("--gpu-gb", type=float, default=150.7, help="device memory, GB (H200: 140.4 GiB)")
    p.add_argument("--usable-memory", type=float, default=0.8, help="share of it for training state")
    p.add_argument("--mfu", type=float, default=0.3)
    p.add_argument("--engine-gpus", type=int, default=16, help="GPUs per engine (the recipe: TP16 x 8 engines)")
    p.add_argument("--decode-base-ms", type=float, default=24.0,
                   help="per decode step: bf16 weights (1.49 TB) read over 16 x 4.8 TB/s at 80%%")
    p.add_argument("--decode-per-seq-ms", type=float, default=0.016,
                   help="per running trajectory per step: its sparse-attention KV reads and 2 x 41.8 GFLOP")
    p.add_argument("--max-inflight", type=int, default=256, help="trajectories per engine (KV: ~5.1 M tokens)")
    p.add_argument("--max-inflight-total", type=int, default=0,
                   help="trajectories generating at once over all engines (0: no cap beyond the engines')")
    p.add_argument("--len-median", type=float, default=6000, help="generated tokens per trajectory, median")
    p.add_argument("--len-sigma", type=float, default=1.0)
    p.add_argument("--len-max", type=int, default=45000)
    p.add_argument("--gen-frac", type=float, default=0.35, help="generated share of a trajectory's tokens")
    p.add_argument("--batch", type=int, default=128, help="trajectories per step (SAO 128 x 1, GRPO 16 x 8)")
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--staleness-check", choices=("token", "trajectory"), default="token")
    p.add_argument("--train-fixed-s", type=float, default=0.0)
    p.add_argument("--sync-s", type=float, default=30.0,
                   help="weight sync pause: 1.49 TB from trainer rank 0 over one 400 Gb/s NIC")
    p.add_argument("--switch-s", type=float, default=20.0, help="colocated: offload / reload per step")
    p.add_argument("--max-rows", type=int, default=16, help="splits shown (every k-th engine count)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup-steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.from_bench:
        replay(args)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
