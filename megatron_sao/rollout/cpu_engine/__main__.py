"""`python -m megatron_sao.rollout.cpu_engine --model HF_DIR --port PORT [options]`."""

from __future__ import annotations

import argparse
import logging
import os

from megatron_sao.rollout.cpu_engine.server import CPUEngine, CPUEngineConfig, create_app


def parse_args(argv: list[str] | None = None) -> CPUEngineConfig:
    parser = argparse.ArgumentParser(prog="python -m megatron_sao.rollout.cpu_engine", description=__doc__)
    parser.add_argument("--model", "--model-path", dest="model_path", required=True, help="HF checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--max-prefill-tokens", type=int, default=16384)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument(
        "--return-original-logprob",
        action="store_true",
        default=os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"),
        help="log-probs of the temperature-1 distribution (SGLang: SGLANG_RETURN_ORIGINAL_LOGPROB=1)",
    )
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    return CPUEngineConfig(
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        threads=args.threads or None,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        weight_version=args.weight_version,
        random_seed=args.random_seed,
        return_original_logprob=args.return_original_logprob,
    )


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    config = parse_args(argv)
    engine = CPUEngine(config)
    engine.start()
    try:
        uvicorn.run(create_app(engine), host=config.host, port=config.port, log_level="warning", lifespan="off")
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
