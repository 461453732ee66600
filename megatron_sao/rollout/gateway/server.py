"""The agent gateway: an OpenAI-compatible HTTP server in front of the engine pool.

Every episode gets a session and its own base URL, `{gateway}/sessions/<id>/v1`, so an unmodified
scaffold needs only `OPENAI_BASE_URL` (and any `OPENAI_API_KEY`: the session id in the path is
the credential, 128 random bits; the server binds to 127.0.0.1 unless told otherwise). Endpoints
under it: `POST chat/completions`, `POST completions`, `GET models`; `GET /v1/models` and
`GET /health` at the root.

The server runs on the caller's event loop (`await gateway.start()`), the loop the engine pool
and its clients live on: a request handler awaits the pool directly, so thousands of sessions
cost coroutines, not threads. What a session records is in `session.py`; the request surface in
`openai_api.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from megatron_sao.rollout.chat_format import ChatFormat
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.gateway import openai_api as api
from megatron_sao.rollout.gateway.messages import RequestError
from megatron_sao.rollout.gateway.session import GatewaySession
from megatron_sao.rollout.gateway.tool_parsers import ToolCallFormat, get_tool_format, tool_format_for
from megatron_sao.rollout.gateway.types import GatewayError, SessionLimits

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 0
    """0: a free port, chosen when the server starts."""
    model_name: str = "sao-policy"
    """The id `/v1/models` lists; requests may name any model (the policy answers all)."""
    tool_call_format: str | ToolCallFormat = "auto"
    """How the model writes tool calls: qwen3, glm, "module:attribute" (`tool_parsers.py`), or auto
    (glm when the chat template renders GLM's markup, else qwen3)."""
    stop_token_ids: list[int] | None = None
    """Tokens that end a model turn; None: the tokenizer's EOS (`<|im_end|>` for Qwen)."""
    limits: SessionLimits = field(default_factory=SessionLimits)


class Gateway:
    def __init__(self, pool: EnginePool, tokenizer: Any, config: GatewayConfig | None = None) -> None:
        self.config = config or GatewayConfig()
        self.pool = pool
        self.chat = ChatFormat(tokenizer, self.config.stop_token_ids)
        spec = self.config.tool_call_format
        self.tool_format = get_tool_format(tool_format_for(tokenizer) if spec == "auto" else spec)
        self.sessions: dict[str, GatewaySession] = {}
        self.app = self._build_app()
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    # ---- sessions -----------------------------------------------------------------------------

    def open_session(self, prompt_id: str, metadata: dict[str, Any] | None = None) -> GatewaySession:
        session_id = secrets.token_hex(16)
        session = GatewaySession(session_id, prompt_id, self.chat, self.pool, self.tool_format, self.config.limits,
                                 metadata)
        self.sessions[session_id] = session
        return session

    def close_session(self, session: GatewaySession) -> None:
        """Later requests of the session get 404 (a scaffold that outlives its episode records nothing)."""
        self.sessions.pop(session.session_id, None)

    def session_url(self, session: GatewaySession) -> str:
        return f"{self.url}/sessions/{session.session_id}/v1"

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the gateway is not started")
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> str:
        """Serve on the running loop; returns the root URL once the server accepts connections."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=30, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._server.capture_signals = contextlib.nullcontext  # the host process owns its signals
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the gateway server exited while starting")
            await asyncio.sleep(0.01)
        return self.url

    async def stop(self) -> None:
        for session in self.sessions.values():
            session.abort()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._server = self._task = None

    # ---- HTTP ---------------------------------------------------------------------------------

    def _session(self, session_id: str) -> GatewaySession:
        session = self.sessions.get(session_id)
        if session is None:
            raise GatewayError(404, f"no open session {session_id!r} (the episode ended or never started)",
                               "session_not_found")
        return session

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="megatron-sao agent gateway")
        name = self.config.model_name

        @app.exception_handler(RequestError)
        async def bad_request(_: Request, e: RequestError) -> JSONResponse:
            return JSONResponse(api.error_body(str(e), e.code, e.param), status_code=400)

        @app.exception_handler(GatewayError)
        async def gateway_error(_: Request, e: GatewayError) -> JSONResponse:
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            return JSONResponse(api.error_body(str(e), e.code, kind=kind), status_code=e.status)

        models = {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "megatron-sao"}]}

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "sessions": len(self.sessions)}

        @app.get("/v1/models")
        async def root_models() -> dict[str, Any]:
            return models

        @app.get("/sessions/{session_id}/v1/models")
        async def session_models(session_id: str) -> dict[str, Any]:
            self._session(session_id)
            return models

        @app.post("/v1/chat/completions")
        @app.post("/v1/completions")
        async def no_session() -> JSONResponse:
            raise GatewayError(404, "use the episode's session URL: {gateway}/sessions/<id>/v1", "session_required")

        @app.post("/sessions/{session_id}/v1/chat/completions")
        async def chat_completions(session_id: str, request: Request) -> Any:
            session = self._session(session_id)
            req = api.parse_chat_request(await _json(request))
            gen = await session.chat_turn(req.messages, req.tools, req.turn, req.parse_calls)
            if req.stream:
                return _sse(api.chat_chunks(gen, req.model or name, req.include_usage))
            texts = [self.chat.tokenizer.decode([t], skip_special_tokens=False) for t in gen.token_ids]
            return api.chat_completion(gen, req.model or name, texts if req.logprobs else None)

        @app.post("/sessions/{session_id}/v1/completions")
        async def completions(session_id: str, request: Request) -> Any:
            session = self._session(session_id)
            body = await _json(request)
            turn = api.turn_request(body)
            gen = await session.complete(api.parse_completion_prompt(body), turn)
            model = str(body.get("model") or name)
            return _sse(api.completion_chunks(gen, model)) if body.get("stream") else api.completion(gen, model)

        return app


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as e:
        raise RequestError(f"the request body is not JSON: {e}") from e


def _sse(chunks: Iterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
