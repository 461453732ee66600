"""Request bodies and error answers of the CPU engine's HTTP server.

Bodies are read with a size cap (413 beyond) and parsed as JSON (optionally off the event loop);
errors come back as SGLang's `{"error": {"message": ...}}`: 400 for bad input (any ValueError,
malformed JSON included), 413 for a body over the limit, 503 while the engine stops, and a 500
naming the error for anything else (logged with its traceback) — never a bare 500 page.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)


class RequestTooLarge(ValueError):
    """A request body over `CPUEngineConfig.max_request_bytes` (answered 413)."""


class EngineStopping(RuntimeError):
    """The engine is shutting down (answered 503, as SGLang answers while it cannot serve)."""


def error_response(message: str, status_code: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status_code)


async def read_json_body(
    request: Request, max_bytes: int, run: Callable[[Callable[[], Any]], Any] | None = None
) -> Any:
    """The request's JSON body ({} when empty), read up to `max_bytes` (RequestTooLarge beyond)
    and parsed by `run` (off the event loop) when given. Malformed JSON raises ValueError."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLarge(f"the request body ({int(declared)} bytes) exceeds the engine's limit of {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestTooLarge(f"the request body exceeds the engine's limit of {max_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        return {}

    def parse() -> Any:
        try:
            return json.loads(raw)
        except RecursionError as e:
            raise ValueError("the request body is nested too deeply") from e
        except ValueError as e:
            raise ValueError(f"the request body is not valid JSON: {e}") from e

    return await run(parse) if run is not None else parse()


async def json_object_body(request: Request) -> dict[str, Any]:
    data = await read_json_body(request, 1 << 20)
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    return data


def register_error_handlers(app: FastAPI) -> None:
    """No request gets a bare 500: bad input is 400 (413 when too large), a stopping engine 503,
    and anything else a 500 that names the error (and is logged with its traceback)."""

    @app.exception_handler(RequestTooLarge)
    async def too_large(_: Request, e: RequestTooLarge):
        return error_response(str(e), 413)

    @app.exception_handler(ValueError)
    async def bad_request(_: Request, e: ValueError):
        return error_response(str(e), 400)

    @app.exception_handler(EngineStopping)
    async def stopping(_: Request, e: EngineStopping):
        return error_response(str(e), 503)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        logger.exception("CPU engine: %s %s failed", request.method, request.url.path)
        return error_response(f"internal error: {e!r}", 500)
