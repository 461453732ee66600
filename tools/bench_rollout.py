"""CPU engine throughput: generated tokens/s at several batch sizes, through real HTTP.

    python tools/bench_rollout.py                      # tiny Qwen3-MoE, batch 1 / 8 / 32
    python tools/bench_rollout.py --model HF_DIR --threads 2 --batch-sizes 1 8 32 64
    python tools/bench_rollout.py --routing            # also: returning routed experts (R3)

The engine runs as its own process (started by EngineSupervisor, as in a run); `batch` concurrent
clients each send one `/generate` of `--new-tokens` tokens (ignore_eos, temperature 1,
return_logprob) at a time, for `--rounds` rounds. tokens/s counts generated tokens only; the
prompt is prefilled once per request. The machine's load average is printed because shared
CPUs make the numbers noisy.

With `--routing` a second engine runs with `--enable-return-routed-experts` and its requests set
`return_routed_experts` (what a run with routing replay does); the two engines are measured in
alternating rounds, and the table adds that engine's tokens/s, the slowdown, and the routing
payload per token position: `meta_info.routed_experts` as sent (base64 of int32
[positions, layers, k]) and as the trajectory record keeps it (int16, MoE layers only).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_sao.rollout.client import EngineClient, SamplingParams
from megatron_sao.rollout.engine_supervisor import EngineConfig, EngineSupervisor


async def measure(url: str, batch: int, new_tokens: int, prompt_len: int, rounds: int,
                  routing: bool = False) -> tuple[int, float, int, int]:
    """(generated tokens, seconds, routed positions, routing payload characters)."""
    client = EngineClient(url)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 for j in range(prompt_len)] for i in range(batch)]
    await asyncio.gather(*(client.generate(p, SamplingParams(max_new_tokens=4), return_routed_experts=routing)
                           for p in prompts))  # warm-up
    start = time.perf_counter()
    generated = positions = payload = 0
    for _ in range(rounds):
        outs = await asyncio.gather(*(client.generate(p, params, return_routed_experts=routing) for p in prompts))
        generated += sum(o.completion_tokens for o in outs)
        positions += sum(prompt_len + o.completion_tokens - 1 for o in outs if o.routed_experts is not None)
        payload += sum(len(o.routed_experts) for o in outs if o.routed_experts is not None)
    elapsed = time.perf_counter() - start
    await client.close()
    return generated, elapsed, positions, payload


def routing_rows(model: str) -> tuple[int, int]:
    """(layers x k of SGLang's payload, MoE layers x k of the record) per token position."""
    import json

    from megatron_sao.rollout.routing import routing_spec_from_hf_config

    spec = routing_spec_from_hf_config(json.loads((Path(model) / "config.json").read_text()))
    return spec.num_layers * spec.topk, spec.num_moe_layers * spec.topk


def compare_routing(plain_url: str, routed_url: str, model: str, args: argparse.Namespace) -> None:
    """Alternating rounds on the plain engine and the one returning routed experts."""
    wire, record = routing_rows(model)
    print(f"routing payload per token position: {wire * 4} B int32 on the wire (base64: x4/3), "
          f"{record * 2} B int16 in the record")
    print(f"{'batch':>5} {'plain tok/s':>12} {'routing tok/s':>14} {'slowdown':>9} {'payload B/token':>16}")
    for batch in args.batch_sizes:
        totals = {False: [0, 0.0], True: [0, 0.0]}
        positions = chars = 0
        for _ in range(args.rounds):
            for routing in (False, True):
                generated, elapsed, pos, payload = asyncio.run(
                    measure(routed_url if routing else plain_url, batch, args.new_tokens, args.prompt_len, 1, routing))
                totals[routing][0] += generated
                totals[routing][1] += elapsed
                positions, chars = positions + pos, chars + payload
        plain, routed = (totals[r][0] / totals[r][1] for r in (False, True))
        print(f"{batch:>5} {plain:>12.0f} {routed:>14.0f} {100 * (plain / routed - 1):>8.1f}% "
              f"{chars / max(positions, 1):>16.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: build the tiny Qwen3-MoE)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--routing", action="store_true",
                        help="also measure an engine returning routed experts (slowdown, payload bytes per token)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="sao_bench_") as tmp:
        model = args.model
        if model is None:
            from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint

            model = str(build_tiny_hf_checkpoint(Path(tmp) / "tiny"))
        config = EngineConfig(
            backend="cpu",
            model_path=model,
            cpu_threads=args.threads,
            max_running_requests=max(args.batch_sizes),
            log_dir=str(Path(tmp) / "logs"),
        )
        with EngineSupervisor(config) as supervisor:
            print(
                f"CPU engine: {model}, torch threads {args.threads}, cores {os.cpu_count()}, "
                f"load average {os.getloadavg()[0]:.1f}"
            )
            print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per request, {args.rounds} rounds")
            if args.routing:
                routed_config = dataclasses.replace(config, return_routed_experts=True,
                                                    log_dir=str(Path(tmp) / "logs_routed"))
                with EngineSupervisor(routed_config) as routed:
                    compare_routing(supervisor.urls[0], routed.urls[0], model, args)
                return
            print(f"{'batch':>5} {'tokens':>8} {'seconds':>8} {'tokens/s':>10} {'ms/step':>8}")
            for batch in args.batch_sizes:
                generated, elapsed, _, _ = asyncio.run(
                    measure(supervisor.urls[0], batch, args.new_tokens, args.prompt_len, args.rounds)
                )
                ms_per_step = 1000 * elapsed / (args.rounds * args.new_tokens)
                print(f"{batch:>5} {generated:>8} {elapsed:>8.2f} {generated / elapsed:>10.0f} {ms_per_step:>8.2f}")


if __name__ == "__main__":
    main()
