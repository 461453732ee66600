"""`python -m megatron_sao.cpu_engine --model HF_DIR --port PORT [options]`.

Prints `ready on http://HOST:PORT` once it serves. Stops on the first SIGINT / SIGTERM: requests
in flight are answered (503) and the process exits. Third-party output (transformers, uvicorn,
torch) goes to `--log-file`; without it, to a file in the temp directory when stderr is a
terminal, and stays on stderr otherwise (a launcher that captures it, as rollout/engine_supervisor.py does).

Started by an engine supervisor (SAO_PARENT_PID set), it also stops when that process is gone,
however it ended (utils/lifetime.py `die_with_parent`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from megatron_sao.cpu_engine.server import CPUEngine, CPUEngineConfig, create_app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m megatron_sao.cpu_engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--model-path", dest="model_path", required=True, help="HF checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--max-prefill-tokens", type=int, default=16384)
    parser.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body (413 beyond)")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument(
        "--return-original-logprob",
        action="store_true",
        default=os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"),
        help="log-probs of the temperature-1 distribution (SGLang: SGLANG_RETURN_ORIGINAL_LOGPROB=1)",
    )
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        help="streamed chunks carry only what is new (SGLang's flag of the same name)")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="record routed experts for requests that set return_routed_experts (SGLang's flag)")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--log-file", default=None, help="where third-party output goes (see above)")
    parser.add_argument("-v", "--verbose", action="store_true", help="keep all output on the terminal")
    return parser


def parse_args(argv: list[str] | None = None) -> CPUEngineConfig:
    return _config(build_parser().parse_args(argv))


def _config(args: argparse.Namespace) -> CPUEngineConfig:
    if args.max_request_mb <= 0:
        raise ValueError(f"--max-request-mb must be > 0, got {args.max_request_mb}")
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
        max_request_bytes=int(args.max_request_mb * 1024 * 1024),
        incremental_streaming_output=args.incremental_streaming_output,
        enable_return_routed_experts=args.enable_return_routed_experts,
    )


def _log_path(args: argparse.Namespace) -> Path | None:
    if args.verbose:
        return None
    if args.log_file:
        return Path(args.log_file)
    if sys.stderr.isatty():
        from megatron_sao.utils.console import default_log_path

        return default_log_path(f"cpu-engine-{args.port}")
    return None


def serve(config: CPUEngineConfig, log_level: str = "warning") -> str | None:
    """Load the model, serve until the first SIGINT / SIGTERM (or a fatal error, which SGLang's
    scheduler would crash on: returned), then stop."""
    import uvicorn

    from megatron_sao.utils.console import console_out

    engine = CPUEngine(config)

    class EngineServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(f"ready on http://{config.host}:{config.port}", file=console_out(), flush=True)

        interrupted = False

        def handle_exit(self, sig: int, frame) -> None:  # type: ignore[no-untyped-def]
            # The scheduler stops after its current step and answers every request in flight (503),
            # so the graceful shutdown that follows has nothing to wait for.
            engine.scheduler.request_stop()
            self.interrupted = self.interrupted or sig == signal.SIGINT
            super().handle_exit(sig, frame)

    uv_config = uvicorn.Config(create_app(engine), host=config.host, port=config.port, log_level=log_level,
                               lifespan="off", timeout_graceful_shutdown=5)
    server = EngineServer(uv_config)
    engine.scheduler.on_fatal = lambda: setattr(server, "should_exit", True)
    engine.start()
    try:
        server.run()
    finally:
        engine.stop()
    # uvicorn re-raises the SIGINT it handled once it is done, but asyncio's runner can absorb it
    # when the serving task ends in the same step (seen under load: exit code 0 instead of 130)
    if server.interrupted:
        raise KeyboardInterrupt
    return engine.scheduler.fatal_error


def main(argv: list[str] | None = None) -> int:
    from megatron_sao.utils.console import console_err, quiet_output
    from megatron_sao.utils.lifetime import die_with_parent

    die_with_parent()  # started by an engine supervisor (SAO_PARENT_PID): stop when it is gone
    args = build_parser().parse_args(argv)
    log = _log_path(args)
    with quiet_output(log) if log is not None else contextlib.nullcontext():
        logging.basicConfig(level=args.log_level.upper())
        if log is not None:
            print(f"CPU engine: third-party output goes to {log} (-v keeps it here)", file=console_err(), flush=True)
        try:
            fatal = serve(_config(args), args.log_level)
        except ValueError as e:
            print(f"cpu_engine: error: {e}", file=console_err(), flush=True)
            return 2
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled
            print("cpu_engine: stopped", file=console_err(), flush=True)
            return 130
        if fatal is not None:
            print(f"cpu_engine: stopped: {fatal}", file=console_err(), flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
