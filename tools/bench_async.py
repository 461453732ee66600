"""Async SAO vs synchronous baselines on the real pipeline, with long-tailed rollouts.

    python tools/bench_async.py                              # 3 modes x 8 steps, ~5 min on 2 quiet cores
    python tools/bench_async.py --steps 20 --turns-sigma 1.5 --json out.json
    python tools/simulate_async.py --from-bench out.json     # replay the measured costs

Every mode runs the same code as `sao train RECIPE rollout.source=engine` (EngineSource: the ready
buffer, one CPU engine process behind the agent loop, weight sync after every actor step; the
trainer is SaoTrainer on the tiny MoE, one rank), at equal engine capacity (the same engine,
`--inflight` trajectories in flight at most) and equal trajectories per step (`--batch`):

- `sao`: group 1, async: engines never wait for the trainer (back-pressure at 2 x batch
  buffered), `algorithm.max_staleness` = `--max-staleness` (token check, drop);
- `sync_single`: group 1, a barrier per batch (`ReadyBuffer(barrier=True)`): the batch generates,
  then the trainer trains and syncs, then the next batch starts (staleness 0);
- `sync_grpo`: groups of `--group` (batch / group prompts x group samples), the same barrier,
  GRPO advantages, PPO clip with recomputed old log-probs, no critic.

Rollout lengths (the `longtail` environment): each episode lasts N ~ lognormal(median
`--turns-median`, sigma `--turns-sigma`) assistant turns, clamped to [1, `--max-turns`], drawn in
the order trajectories start (every mode sees the same sequence); each turn ends when the model
samples `<|im_end|>`. The tiny random model would sample it with probability ~1/320 per token, so
the benchmark's checkpoint is made to stop with probability `--stop-prob` per token (a constant
feature in the embeddings and a logit for `<|im_end|>` on it): turns are ~geometric with mean
1/stop-prob tokens. Observations are 8 digits per turn.

Measured per mode, over the whole run (engines started and loaded, both pipelines empty at t=0;
the async mode's trajectories still buffered at the end count as not trained): trajectories
trained per second, trainer idle fraction (time waiting for a batch / wall time), engine idle
fraction (share of 10 Hz samples of the engine's `/get_server_info` with nothing running or
generation paused) and occupancy (mean running requests / `--inflight`), staleness of the trained
trajectories (oldest action token; p50 / p99), trajectories dropped as too stale. Ratios are
against the synchronous modes of the same run. On a shared 2-core box the trainer (1 thread) and
the engine (1 thread) each get a core; the rollout thread shares the trainer's process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("sao", "sync_single", "sync_grpo")
STOP_FEATURE = 0  # hidden dimension that carries the constant "stop" feature


def stop_tuned_checkpoint(out_dir: Path, stop_prob: float, seed: int = 0) -> Path:
    """The tiny MoE whose probability of sampling `<|im_end|>` is ~`stop_prob` at every position."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint

    if not 0 < stop_prob < 1:
        raise ValueError(f"--stop-prob must be in (0, 1), got {stop_prob}")
    path = build_tiny_hf_checkpoint(out_dir, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    stop = AutoTokenizer.from_pretrained(path).eos_token_id
    embed, head = model.model.embed_tokens.weight.data, model.lm_head.weight.data
    # A constant component of every embedding survives the residual stream and the final norm as
    # a near-constant feature h0; only `<|im_end|>` reads it, which acts as a logit bias.
    embed[:, STOP_FEATURE] = 10 * embed.std()
    head[:, STOP_FEATURE] = 0.0
    with torch.no_grad():
        ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(seed))
        h0 = model.model(ids).last_hidden_state[..., STOP_FEATURE].mean().item()
    head[stop] = 0.0
    head[stop, STOP_FEATURE] = math.log((head.shape[0] - 1) * stop_prob / (1 - stop_prob)) / h0
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_prompts(path: Path, num_prompts: int) -> Path:
    with path.open("w") as f:
        for i in range(num_prompts):
            f.write(json.dumps({"id": f"bench-{i}", "prompt": f"episode {i}: act until told to stop"}) + "\n")
    return path


def mode_overrides(mode: str, args: argparse.Namespace, hf_dir: str, prompts: str, work: str) -> list[str]:
    env = {"turns_median": args.turns_median, "turns_sigma": args.turns_sigma, "max_turns": args.max_turns,
           "seed": args.seed}
    common = [
        f"run.output_dir={work}", f"run.name={mode}", f"run.seed={args.seed}", f"model.hf_path={hf_dir}",
        "model.dtype=float32", "launcher.nproc_per_node=1", "launcher.engine_placement=disaggregated",
        "logging.param_table=false", "logging.wandb_mode=disabled", "checkpoint.save_every=0",
        "rollout.source=engine", "rollout.engine=cpu", "rollout.num_engines=1", "rollout.environment=longtail",
        f"rollout.environment_kwargs={json.dumps(env)}", f"rollout.max_turns={args.max_turns}",
        f"rollout.max_new_tokens_per_turn={args.max_new_tokens_per_turn}",
        f"rollout.max_total_tokens={args.max_total_tokens}", f"rollout.max_inflight_per_engine={args.inflight}",
        f"data.train_path={prompts}", f"data.batch_size={args.batch}", "critic.warmup_steps=0",
        "actor.optim.lr=1e-5", "critic.optim.lr=5e-5", "actor.micro_batch_size=4", "critic.micro_batch_size=4",
        f"run.total_steps={args.steps}",
    ]
    if mode == "sao":
        return [*common, f"algorithm.max_staleness={args.max_staleness}"]
    if mode == "sync_single":
        return [*common, "algorithm.max_staleness=0", "pipeline.barrier=true"]
    if mode == "sync_grpo":
        return [*common, "algorithm.max_staleness=0", "pipeline.barrier=true", f"algorithm.group_size={args.group}",
                "algorithm.advantage=grpo", "algorithm.policy_loss=ppo_clip", "algorithm.old_logprobs=recompute"]
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


class EngineSampler:
    """Polls every engine's `/get_server_info` from a thread: what runs, paused, counters."""

    def __init__(self, urls: list[str], interval_s: float) -> None:
        self.urls, self.interval_s = urls, interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-sampler", daemon=True)

    def __enter__(self) -> EngineSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=5.0) as http:
            while not self._stop.wait(self.interval_s):
                for index, url in enumerate(self.urls):
                    try:
                        info = http.get(f"{url}/get_server_info").json()
                    except (httpx.HTTPError, ValueError):
                        continue
                    load = info["internal_states"][0]
                    self.samples.append({"t": time.perf_counter(), "engine": index, "paused": info["paused"],
                                         "running": load["num_running_reqs"], "waiting": load["num_waiting_reqs"],
                                         "steps": info["stats"]["num_steps"],
                                         "tokens": info["stats"]["generated_tokens"]})


def engine_summary(samples: list[dict[str, Any]], start: float, end: float, inflight: int) -> dict[str, float]:
    """Idle fraction, occupancy, tokens/s and decode step times of the engines over [start, end]."""
    window = [s for s in samples if start <= s["t"] <= end]
    if len(window) < 2:
        return {}
    busy = [not s["paused"] and s["running"] + s["waiting"] > 0 for s in window]
    out = {"idle_frac": 1 - sum(busy) / len(busy),
           "occupancy": statistics.fmean(s["running"] for s in window) / inflight}
    by_engine: dict[int, list[dict[str, Any]]] = {}
    for s in window:
        by_engine.setdefault(s["engine"], []).append(s)
    tokens = sum(ss[-1]["tokens"] - ss[0]["tokens"] for ss in by_engine.values())
    out["tokens_per_s"] = tokens / (end - start)
    # (running, seconds per decode step) between consecutive busy samples: simulate_async.py fits
    # its engine cost on them (prefill folded in)
    out["decode_points"] = [((a["running"] + b["running"]) / 2, (b["t"] - a["t"]) / (b["steps"] - a["steps"]))
                            for ss in by_engine.values() for a, b in itertools.pairwise(ss)
                            if b["steps"] > a["steps"] and a["running"] and b["running"]
                            and not a["paused"] and not b["paused"]]
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def bench_mode(mode: str, args: argparse.Namespace, hf_dir: str, prompts: str, work: str) -> dict[str, Any]:
    """One mode on this (rank) process: build, run `args.steps` steps, measure."""
    import torch

    from megatron_sao.config import load_config
    from megatron_sao.pipeline.buffer import trajectory_staleness
    from megatron_sao.pipeline.engine_source import EngineSource
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.training.trainer import SaoTrainer

    torch.set_num_threads(args.trainer_threads)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine request otherwise
    config = load_config(None, mode_overrides(mode, args, hf_dir, prompts, work))
    init_model_parallel(config.parallelism, seed=config.run.seed)
    trainer = SaoTrainer(config, mode="rl")
    run_dir = Path(work) / mode
    run_dir.mkdir(parents=True, exist_ok=True)
    source = EngineSource(config, run_dir)
    source.service.engine_config.cpu_threads = args.engine_threads
    assert source.buffer.barrier == (mode != "sao")  # `pipeline.barrier`, set by mode_overrides
    steps: list[dict[str, Any]] = []
    trajectories: list[dict[str, Any]] = []
    try:
        source.start(trainer)
        urls = [c.base_url for c in source.service.pool.clients]
        with EngineSampler(urls, args.sample_interval) as sampler:
            start = time.perf_counter()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                batch = source.next_batch(trainer)
                t1 = time.perf_counter()
                version = trainer.state.actor_version
                stale = [trajectory_staleness(t, version, "token") for t in batch]
                metrics = trainer.train_step(batch)
                t2 = time.perf_counter()
                metrics.update(source.after_step(trainer))
                t3 = time.perf_counter()
                steps.append({"wait_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2,
                              "tokens": sum(len(t) for t in batch),
                              "action_tokens": sum(t.num_action_tokens for t in batch)})
                trajectories += [{"staleness": s, "turns": len(t.turns), "action_tokens": t.num_action_tokens,
                                  "tokens": len(t), "status": str(t.status)} for s, t in zip(stale, batch, strict=True)]
            end = time.perf_counter()
        counts = {k: metrics.get(k, 0.0) for k in ("buffer/dropped_stale", "buffer/kept_stale", "rollout/completed",
                                                   "rollout/failed", "rollout/started", "buffer/num_ready")}
    finally:
        source.close()
    wall = end - start
    wait = sum(s["wait_s"] for s in steps)
    return {"mode": mode, "wall_s": wall, "steps": steps, "trajectories": trajectories, "counts": counts,
            "trained_per_s": len(trajectories) / wall, "trainer_idle_frac": wait / wall,
            "engine": engine_summary(sampler.samples, start, end, args.inflight),
            "staleness_p50": percentile([t["staleness"] for t in trajectories], 0.5),
            "staleness_p99": percentile([t["staleness"] for t in trajectories], 0.99)}


def print_report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{args.steps} steps of {args.batch} trajectories per mode; 1 CPU engine ({args.engine_threads} thread), "
          f"<= {args.inflight} in flight; trainer {args.trainer_threads} thread; turns ~ lognormal(median "
          f"{args.turns_median:g}, sigma {args.turns_sigma:g}) <= {args.max_turns}; stop prob {args.stop_prob:g}/token;"
          f" load average {os.getloadavg()[0]:.1f}")
    head = (f"{'mode':<13}{'traj/s':>8}{'trainer idle':>13}{'engine idle':>12}{'occupancy':>10}{'stale p50/p99':>14}"
            f"{'dropped':>8}{'step s':>8}{'turns p50/p99':>14}{'tokens/traj':>12}")
    print(head)
    for mode, r in results.items():
        traj = r["trajectories"]
        turns = [t["turns"] for t in traj]
        step_s = statistics.fmean(s["train_s"] + s["sync_s"] for s in r["steps"])
        print(f"{mode:<13}{r['trained_per_s']:>8.2f}{r['trainer_idle_frac']:>13.1%}"
              f"{r['engine'].get('idle_frac', float('nan')):>12.1%}{r['engine'].get('occupancy', float('nan')):>10.1%}"
              f"{r['staleness_p50']:>7.0f}/{r['staleness_p99']:<6.0f}{r['counts']['buffer/dropped_stale']:>8.0f}"
              f"{step_s:>8.2f}{percentile(turns, 0.5):>7.0f}/{percentile(turns, 0.99):<6.0f}"
              f"{statistics.fmean(t['tokens'] for t in traj):>12.0f}")
    if "sao" in results:
        for base in ("sync_grpo", "sync_single"):
            if base in results:
                sao, ref = results["sao"], results[base]
                print(f"sao vs {base}: trajectories/s x{sao['trained_per_s'] / ref['trained_per_s']:.2f}, trainer idle "
                      f"{sao['trainer_idle_frac']:.1%} vs {ref['trainer_idle_frac']:.1%}, engine idle "
                      f"{sao['engine'].get('idle_frac', float('nan')):.1%} vs "
                      f"{ref['engine'].get('idle_frac', float('nan')):.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=8, help="actor steps per mode")
    parser.add_argument("--batch", type=int, default=16, help="trajectories per step (every mode)")
    parser.add_argument("--group", type=int, default=8, help="GRPO group size (batch/group prompts per step)")
    parser.add_argument("--inflight", type=int, default=16, help="trajectories in flight on the engine (every mode)")
    parser.add_argument("--max-staleness", type=int, default=4, help="sao's algorithm.max_staleness")
    parser.add_argument("--turns-median", type=float, default=3.0)
    parser.add_argument("--turns-sigma", type=float, default=1.0)
    parser.add_argument("--max-turns", type=int, default=48)
    parser.add_argument("--stop-prob", type=float, default=0.1, help="per-token probability of ending a turn")
    parser.add_argument("--max-new-tokens-per-turn", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=2048)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--sample-interval", type=float, default=0.1, help="seconds between engine samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None,
                        help="write the measurements here (simulate_async.py reads it)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    if args.batch % args.group:
        parser.error(f"--batch {args.batch} is not a multiple of --group {args.group}")

    from megatron_sao.platform import run_distributed

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sao-bench-async-") as tmp:
        hf_dir = stop_tuned_checkpoint(Path(tmp) / "hf", args.stop_prob, seed=args.seed)
        prompts = write_prompts(Path(tmp) / "prompts.jsonl", args.num_prompts)
        for mode in modes:
            started = time.perf_counter()
            results[mode] = run_distributed(bench_mode, 1, mode, args, str(hf_dir), str(prompts), tmp,
                                            timeout_s=3600)[0]
            print(f"{mode}: {results[mode]['wall_s']:.1f} s of steps ({time.perf_counter() - started:.0f} s with "
                  f"start-up)", flush=True)
    print_report(results, args)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(args).items()},
                                         "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
