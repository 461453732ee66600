"""The CPU engine's HTTP server: SGLang's native endpoints over the scheduler.

Endpoints, request bodies and response shapes follow SGLang's `http_server.py` and
`io_struct.py` (sglang 0.5.23); see docs/rollout.md for what is honoured and what is refused (no
constrained decoding, LoRA or multimodal inputs; no prefix cache; tensor payloads in safetensors
form). Errors
come back as SGLang's `{"error": {"message": ...}}`: 400 bad input, 413 too large, 503 stopping
(http_io.py). `/generate` bodies are parsed, tokenised and answered on one worker thread, off the
event loop, so health checks answer while a large request is read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from megatron_sao.cpu_engine.http_io import (
    EngineStopping,
    error_response,
    json_object_body,
    read_json_body,
    register_error_handlers,
)
from megatron_sao.cpu_engine.model_runner import ModelRunner, parse_dtype
from megatron_sao.cpu_engine.occupation import EngineFatal
from megatron_sao.cpu_engine.output import build_output
from megatron_sao.cpu_engine.protocol import PromptLimits, parse_generate
from megatron_sao.cpu_engine.request import EngineRequest
from megatron_sao.cpu_engine.sampling import SamplingConfig
from megatron_sao.cpu_engine.scheduler import Scheduler
from megatron_sao.cpu_engine.streaming import stream_answers
from megatron_sao.cpu_engine.weight_routes import register_weight_routes

logger = logging.getLogger(__name__)
T = TypeVar("T")
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default (http_server.py)


def health_check_timeout_s() -> float:
    """SGLang 0.5.23 reads SGLANG_HEALTH_CHECK_TIMEOUT (seconds, default 20); so does the CPU engine."""
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", HEALTH_CHECK_TIMEOUT_S))


@dataclass(kw_only=True, slots=True)
class CPUEngineConfig:
    """Options of `python -m megatron_sao.cpu_engine` (one field per flag)."""

    model_path: str
    """HF checkpoint directory (config, safetensors, tokenizer)."""
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "float32"
    """Model dtype: float32 (default; log-probs match an fp32 trainer), bfloat16 or float16."""
    threads: int | None = 1
    """torch intra-op threads (None: torch's default). One is fastest for the tiny test models and
    on shared machines, where OpenMP spinning on oversubscribed cores costs 10x; raise it for
    bigger models on dedicated cores."""
    max_running_requests: int = 64
    """Rows in the running batch (continuous batching admits new requests as rows finish)."""
    max_prefill_tokens: int = 16384
    """Tokens prefilled per scheduling round, so long prompts do not starve decoding."""
    weight_version: str = "default"
    """Initial weight version label (SGLang's --weight-version)."""
    random_seed: int = 0
    """Seed of the sampler used by requests without their own sampling_seed."""
    return_original_logprob: bool = False
    """Return temperature-1 log-probs (SGLang: SGLANG_RETURN_ORIGINAL_LOGPROB=1)."""
    max_request_bytes: int = 64 * 1024 * 1024
    """Largest request body read (413 beyond): bounds the memory and parse time of one request."""
    incremental_streaming_output: bool = False
    """Streamed chunks carry only what is new (SGLang's --incremental-streaming-output); the default
    is SGLang's default, cumulative chunks (streaming.py)."""
    enable_return_routed_experts: bool = False
    """Record every token's routed experts so that requests with `return_routed_experts` get them
    (SGLang's --enable-return-routed-experts; without it, as in SGLang, such requests get none)."""


class CPUEngine:
    """Model runner + scheduler + the state the endpoints share."""

    def __init__(self, config: CPUEngineConfig) -> None:
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.config = config
        self.runner = ModelRunner(config.model_path, parse_dtype(config.dtype),
                                  capture_routing=config.enable_return_routed_experts)
        self.scheduler = Scheduler(
            self.runner,
            max_running_requests=config.max_running_requests,
            max_prefill_tokens=config.max_prefill_tokens,
            weight_version=config.weight_version,
            seed=config.random_seed,
            return_original_logprob=config.return_original_logprob,
        )
        self.groups: dict[str, Any] = {}
        self.weight_session: str | None = None
        """The selector of the open weight-update session (`/begin_weight_update`), None when closed."""
        self.started_at = time.time()
        self.limits = PromptLimits(
            context_length=self.runner.context_length,
            vocab_size=self.runner.vocab_size,
            max_prompt_chars=self.runner.context_length * self.runner.max_token_chars,
        )
        # Request parsing (JSON, tokenisation) and answer building (detokenisation) run here, off
        # the event loop, so a large request cannot stall health checks; one worker keeps the
        # tokenizer single-threaded.
        self.io_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-engine-io")

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self.io_pool.shutdown(wait=False, cancel_futures=True)


async def _await_requests(requests: list[EngineRequest], engine: CPUEngine, http: Request) -> None:
    """Wait for `requests`; abort them if the client goes away (SGLang does the same)."""
    futures = [asyncio.wrap_future(r.future) for r in requests]
    pending = set(futures)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=0.5)
        if pending and await http.is_disconnected():
            for req in requests:
                engine.scheduler.call(lambda rid=req.rid: engine.scheduler.abort(rid=rid, exact=True))
            await asyncio.wait(pending)
    for f in futures:
        f.result()


def create_app(engine: CPUEngine) -> FastAPI:
    app = FastAPI(title="megatron-sao CPU engine")
    register_error_handlers(app)
    sched = engine.scheduler
    tok = engine.runner.tokenizer

    async def on_scheduler(fn):
        return await asyncio.wrap_future(sched.call(fn))

    async def off_loop(fn: Callable[[], T]) -> T:
        if not sched.alive:
            raise EngineStopping("the CPU engine is shutting down")
        return await asyncio.get_running_loop().run_in_executor(engine.io_pool, fn)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(http: Request):
        body = await read_json_body(http, engine.config.max_request_bytes, off_loop)
        parsed = await off_loop(lambda: parse_generate(body, tok, engine.limits))
        if not sched.alive:
            raise EngineStopping("the CPU engine is shutting down")
        if parsed.stream:
            events = stream_answers(parsed.requests, sched, tok, parsed.is_batch, off_loop, http.is_disconnected,
                                    incremental=engine.config.incremental_streaming_output)
            return StreamingResponse(events, media_type="text/event-stream")
        for req in parsed.requests:
            sched.submit(req)
        try:
            await _await_requests(parsed.requests, engine, http)
        except ValueError as e:  # e.g. a duplicate rid, refused on the scheduler thread
            return error_response(str(e))
        except RuntimeError as e:  # the engine stopped while the request was in flight
            return error_response(str(e), 503)
        outs = await off_loop(lambda: [build_output(r, tok, sched.weight_version) for r in parsed.requests])
        return JSONResponse(outs if parsed.is_batch else outs[0])

    @app.get("/health")
    @app.get("/health_generate")
    async def health_generate():
        """SGLang 0.5.23's probe is a one-token generate request, which waits while generation is
        paused (`TokenizerManager.generate_request` waits on `is_pause_cond`): a paused engine
        answers 503 after the health timeout unless it continues meanwhile. Otherwise it answers
        at once under load (a busy engine is healthy while its steps keep finishing; SGLang too
        answers from recent progress); only an idle engine runs a one-token probe."""
        if not sched.alive:
            return Response(status_code=503)
        timeout_s = health_check_timeout_s()
        deadline = time.monotonic() + timeout_s
        while sched.paused:
            if time.monotonic() >= deadline or not sched.alive:
                return Response(status_code=503)
            await asyncio.sleep(min(0.05, timeout_s))
        if sched.busy():
            return Response(status_code=200 if sched.stepping_within(timeout_s) else 503)
        probe = EngineRequest(
            rid=f"HEALTH_CHECK_{time.time()}",
            input_ids=[0],
            sampling=SamplingConfig.from_request({"max_new_tokens": 1, "temperature": 0.0}),
            max_new_tokens=1,
        )
        sched.submit(probe)
        try:
            await asyncio.wait_for(asyncio.wrap_future(probe.future), max(deadline - time.monotonic(), 0.01))
        except (TimeoutError, RuntimeError, ValueError):
            sched.call(lambda: sched.abort(rid=probe.rid, exact=True))
            return Response(status_code=503)
        failed = (probe.finish_reason or {}).get("status_code") == 500
        return Response(status_code=503 if failed else 200)

    @app.get("/model_info")
    async def model_info():
        """The keys of 0.5.23's `/model_info` (http_server.py `model_info`); the weight version is
        read here (there is no `/get_weight_version` in 0.5.23)."""
        config = engine.runner.model.config
        return {
            "model_path": engine.runner.model_path,
            "served_model_name": engine.runner.model_path,
            "tokenizer_path": engine.runner.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": sched.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    @app.get("/get_model_info")  # deprecated alias in 0.5.23
    async def get_model_info():
        return await model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")  # deprecated alias in 0.5.23
    async def server_info():
        stats = sched.stats
        return {
            "model_path": engine.runner.model_path,
            "weight_version": sched.weight_version,
            "max_running_requests": sched.max_running_requests,
            "paused": sched.paused,
            "released_memory": sorted(sched.memory.released),
            "engine": "megatron_sao.cpu_engine",
            "uptime_s": time.time() - engine.started_at,
            "internal_states": [sched.load()],
            "stats": {name: getattr(stats, name) for name in stats.__slots__},
        }

    @app.post("/abort_request")
    async def abort_request(http: Request):
        body = await json_object_body(http)
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if rid is not None and not isinstance(rid, str):
            raise ValueError(f"rid must be a string, got {rid!r:.60}")
        if not isinstance(abort_all, bool):
            raise ValueError(f"abort_all must be true or false, got {abort_all!r:.60}")
        await on_scheduler(lambda: sched.abort(rid=rid, abort_all=abort_all))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(http: Request):
        mode = (await json_object_body(http)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be 'abort', 'retract' or 'in_place', got {mode!r:.60}")
        await on_scheduler(lambda: sched.pause(mode))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation():
        await on_scheduler(sched.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # There is no prefix cache to flush; SGLang 0.5.23 refuses unless fully idle (requests
        # paused in place still hold their KV; retracted ones do not).
        idle = await on_scheduler(sched.fully_idle)
        return Response(
            content="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n",
            status_code=200 if idle else 400,
        )

    async def occupation(http: Request, op: Callable[[list[str] | None], list[str]]) -> Response:
        """CPU: nothing to free, but SGLang's rules hold (occupation.py); a misuse stops the engine."""
        tags = (await json_object_body(http)).get("tags")
        if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            raise ValueError(f"tags must be a list of strings or null, got {tags!r:.60}")
        try:
            await on_scheduler(lambda: op(tags))
        except EngineFatal as e:
            return error_response(str(e), 500)
        return JSONResponse(None)  # 0.5.23 answers null on success

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(http: Request):
        return await occupation(http, sched.release_memory)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(http: Request):
        return await occupation(http, sched.resume_memory)

    register_weight_routes(app, engine, on_scheduler)
    return app
