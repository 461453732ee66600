"""`/generate` with `stream: true`: SGLang's server-sent events.

Each event is `data: {json}\\n\\n`; the stream ends with `data: [DONE]\\n\\n` (sglang 0.5.23
`http_server.generate_request`). Chunks are SGLang's default (non-incremental) stream output:
cumulative `text`, `output_ids` and `meta_info` (log-probs included) of one request, sent every
`sampling_params.stream_interval` tokens (default 1; a slow reader gets the latest state, not a
backlog) and once more when it finishes (with `finish_reason`). A batch or `n > 1` request
interleaves its requests' chunks, each tagged with its `index` in the answer list. The text of an
unfinished chunk holds back a possible stop-string prefix and an incomplete UTF-8 character, so
every chunk's text extends the previous one (clients such as SGLang's `RuntimeEndpoint` slice it).
A request that fails mid-stream yields SGLang's error event, `{"error": {"message", ...}}`, before
`[DONE]`. If the client goes away, its unfinished requests are aborted.

With `incremental` (SGLang's `--incremental-streaming-output`) a chunk carries only what is new:
the text and `output_ids` since the previous chunk, and the `output_*` log-prob lists sliced the
same way (SGLang's `_INCREMENTAL_STREAMING_META_INFO_KEYS`); counts and prompt entries stay whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from megatron_sao.cpu_engine.output import build_output
from megatron_sao.cpu_engine.request import EngineRequest
from megatron_sao.cpu_engine.scheduler import Scheduler

POLL_S = 0.5  # how often a quiet stream checks that its client is still there
_INCREMENTAL_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class _Progress:
    """What one request's stream has sent so far."""

    __slots__ = ("done", "sent_text", "sent_tokens")

    def __init__(self) -> None:
        self.sent_tokens = 0
        self.sent_text = ""
        self.done = False


def _event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def _error_event(error: BaseException) -> bytes:
    code = 503 if isinstance(error, RuntimeError) else 400
    return _event({"error": {"message": str(error), "type": "invalid_request_error" if code == 400 else "server_error",
                             "code": code, "retryable": code == 503}})


def _chunks(requests: list[EngineRequest], progress: list[_Progress], tokenizer, version: str,
            tag_index: bool, incremental: bool) -> list[bytes]:
    """The events due now (runs off the event loop: it detokenises)."""
    events = []
    for k, (req, state) in enumerate(zip(requests, progress, strict=True)):
        if state.done:
            continue
        finished = req.future.done()
        if finished and req.future.exception() is not None:
            state.done = True
            events.append(_error_event(req.future.exception()))  # type: ignore[arg-type]
            continue
        num = req.progress
        if not finished and num - state.sent_tokens < req.sampling.stream_interval:
            continue
        out = build_output(req, tokenizer, version, None if finished else num, finished=finished)
        text = out["text"]
        if not text.startswith(state.sent_text):
            text = state.sent_text  # never take back text a client has already shown
        if incremental:
            out["text"], out["output_ids"] = text[len(state.sent_text):], out["output_ids"][state.sent_tokens:]
            for key in _INCREMENTAL_KEYS:
                if key in out["meta_info"]:
                    out["meta_info"][key] = out["meta_info"][key][state.sent_tokens:]
        elif not finished:
            out["text"] = text
        state.sent_tokens, state.sent_text, state.done = len(req.output_ids) if finished else num, text, finished
        if tag_index:
            out["index"] = k
        events.append(_event(out))
    return events


async def stream_answers(requests: list[EngineRequest], scheduler: Scheduler, tokenizer, tag_index: bool,
                         off_loop: Callable, is_disconnected: Callable, incremental: bool = False
                         ) -> AsyncIterator[bytes]:
    """Submit `requests` and yield their events, then `[DONE]`."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def listener() -> None:  # scheduler thread: must never raise into a decode step
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening
            loop.call_soon_threadsafe(wake.set)

    for req in requests:
        req.listener = listener
    progress = [_Progress() for _ in requests]
    for req in requests:
        scheduler.submit(req)
    try:
        while not all(p.done for p in progress):
            try:
                await asyncio.wait_for(wake.wait(), POLL_S)
            except TimeoutError:
                if await is_disconnected():
                    return
                continue
            wake.clear()
            version = scheduler.weight_version
            try:
                events = await off_loop(lambda v=version: _chunks(requests, progress, tokenizer, v, tag_index,
                                                                    incremental))
            except RuntimeError as e:  # the engine is stopping
                yield _error_event(e)
                break
            for event in events:
                yield event
        yield b"data: [DONE]\n\n"
    finally:
        for req, state in zip(requests, progress, strict=True):
            req.listener = None
            if not state.done and not req.future.done():
                scheduler.call(lambda rid=req.rid: scheduler.abort(rid=rid, exact=True))
