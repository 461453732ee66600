"""CPU engine throughput: generated tokens/s at several batch sizes, through real HTTP.

    python tools/bench_rollout.py                      # tiny Qwen3-MoE, batch 1 / 8 / 32
    python tools/bench_rollout.py --model HF_DIR --threads 2 --batch-sizes 1 8 32 64

The engine runs as its own process (started by EngineSupervisor, as in a run); `batch` concurrent
clients each send one `/generate` of `--new-tokens` tokens (ignore_eos, temperature 1,
return_logprob) at a time, for `--rounds` rounds. tokens/s counts generated tokens only; the
prompt is prefilled once per request. The machine's load average is printed because shared
CPUs make the numbers noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_sao.rollout.client import EngineClient, SamplingParams
from megatron_sao.rollout.engine_supervisor import EngineConfig, EngineSupervisor


async def measure(url: str, batch: int, new_tokens: int, prompt_len: int, rounds: int) -> tuple[int, float]:
    client = EngineClient(url)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 for j in range(prompt_len)] for i in range(batch)]
    await asyncio.gather(*(client.generate(p, SamplingParams(max_new_tokens=4)) for p in prompts))  # warm-up
    start = time.perf_counter()
    generated = 0
    for _ in range(rounds):
        outs = await asyncio.gather(*(client.generate(p, params) for p in prompts))
        generated += sum(o.completion_tokens for o in outs)
    elapsed = time.perf_counter() - start
    await client.close()
    return generated, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: build the tiny Qwen3-MoE)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="sao_bench_") as tmp:
        model = args.model
        if model is None:
            from megatron_sao.utils.tiny_hf import build_tiny_hf_checkpoint

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
            print(f"{'batch':>5} {'tokens':>8} {'seconds':>8} {'tokens/s':>10} {'ms/step':>8}")
            for batch in args.batch_sizes:
                generated, elapsed = asyncio.run(
                    measure(supervisor.urls[0], batch, args.new_tokens, args.prompt_len, args.rounds)
                )
                ms_per_step = 1000 * elapsed / (args.rounds * args.new_tokens)
                print(f"{batch:>5} {generated:>8} {elapsed:>8.2f} {generated / elapsed:>10.0f} {ms_per_step:>8.2f}")


if __name__ == "__main__":
    main()
