"""An async client for SGLang's native HTTP API (and the CPU engine, which speaks the same).

Matched to sglang 0.5.23 (the version requirements-gpu.txt pins): routes from its
`srt/entrypoints/http_server.py`, request bodies from `srt/managers/io_struct.py`; the default
test suite checks every call below against that package's own FastAPI app and request classes
(tests/rollout/test_sglang_conformance.py). Field names and response shapes are SGLang's own, so
the same calls drive a real SGLang server and the CPU engine:

- `POST /generate` with `input_ids`, `sampling_params`, `return_logprob` -> `text`,
  `output_ids`, `meta_info.output_token_logprobs` (`[logprob, token_id, text|null]`),
  `meta_info.finish_reason` (`{"type": "stop"|"length"|"abort", ...}`), `weight_version`;
- `GET /health_generate`; `GET /model_info` (its `weight_version` is the engine's current
  version: 0.5.23 has no `/get_weight_version`), `GET /server_info`;
- `POST /abort_request {rid, abort_all}`; `POST /pause_generation {mode}`,
  `POST /continue_generation`; `POST /flush_cache`;
- `POST /release_memory_occupation {tags}`, `POST /resume_memory_occupation {tags}`;
- `POST /begin_weight_update {selector}` ... `POST /end_weight_update`: the weight-update
  session; 0.5.23 refuses tensor and distributed updates outside it
  (`managers/scheduler_components/weight_updater.py`);
- `POST /update_weights_from_disk`, `/update_weights_from_tensor`,
  `/init_weights_update_group`, `/update_weights_from_distributed`,
  `/destroy_weights_update_group`, `/update_weight_version`.

Errors: an engine that cannot be reached, drops the connection, answers 503 or does not answer
within the read timeout raises `EngineUnavailableError` (the caller may retry elsewhere: the engine
crashed, hangs or is restarting); any other error status raises `EngineError` with the engine's
message. Every call has finite timeouts: connecting (10 s), control calls (60 s between bytes) and
`/generate` and weight updates (an hour: a non-streamed answer arrives only when the whole generation is done, and
a long agentic turn on a loaded engine can take many minutes). A health monitor (`health_generate`,
its own short timeout) is what notices a hung engine early.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any, Literal

import httpx

from megatron_sao.rollout.engine_protocol import (
    EngineError,
    EngineUnavailableError,
    FinishReason,
    GenerateOutput,
    SamplingParams,
    VersionSpan,
)

__all__ = [
    "EngineClient",
    "EngineError",
    "EngineUnavailableError",
    "FinishReason",
    "GenerateOutput",
    "PauseMode",
    "SamplingParams",
    "VersionSpan",
]

PauseMode = Literal["abort", "retract", "in_place"]


class EngineClient:
    """One engine (one SGLang server / CPU engine) at `base_url`. Safe to share between tasks
    of one event loop; a new loop gets its own connection pool."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        max_connections: int = 1024,
        api_key: str | None = None,
        generate_timeout_s: float = 3600.0,
    ) -> None:
        """`timeout_s`: read / write / pool timeout of control calls; `generate_timeout_s`: read
        timeout of `/generate` (the whole generation); `connect_timeout_s`: connecting."""
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s),
                            ("generate_timeout_s", generate_timeout_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"EngineClient {name} must be a finite number > 0, got {value!r}")
        self.base_url = base_url.rstrip("/")
        self.timeouts = {"connect": float(connect_timeout_s), "read": float(timeout_s),
                         "generate_read": float(generate_timeout_s)}
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._generate_timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s, read=generate_timeout_s)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(
                base_url=self.base_url, timeout=self._timeout, limits=self._limits, headers=self._headers
            )
            self._client_loop = loop
        return self._client

    async def close(self) -> None:
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = None

    async def _request(
        self, method: str, path: str, json: Any = None, timeout_s: float | httpx.Timeout | None = None
    ) -> httpx.Response:
        kwargs: dict[str, Any] = {}
        if json is not None:
            kwargs["json"] = json
        if timeout_s is not None:
            kwargs["timeout"] = timeout_s
        try:
            response = await self._http().request(method, path, **kwargs)
        except (httpx.TransportError, httpx.TimeoutException) as e:  # connect / read / protocol errors
            raise EngineUnavailableError(self.base_url, f"{method} {path} failed: {e!r}") from e
        if response.status_code >= 400:
            message = _error_message(response)
            error = EngineUnavailableError if response.status_code == 503 else EngineError
            raise error(self.base_url, f"{method} {path}: {message}", response.status_code)
        return response

    async def _post_json(
        self, path: str, payload: dict[str, Any] | None = None, timeout: httpx.Timeout | None = None
    ) -> Any:
        response = await self._request("POST", path, json=payload or {}, timeout_s=timeout)
        return response.json() if response.content else None

    async def _post_update(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Weight endpoints answer `{"success", "message"}` (400 on failure)."""
        # Weight updates of a large model (a disk read, a group join, a broadcast) take minutes.
        result = await self._post_json(path, {k: v for k, v in payload.items() if v is not None},
                                       timeout=self._generate_timeout)
        if not isinstance(result, dict) or not result.get("success", False):
            raise EngineError(self.base_url, f"POST {path} did not succeed: {result}")
        return result

    # ---- generation -------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | dict[str, Any],
        rid: str | None = None,
        return_logprob: bool = True,
        **extra: Any,
    ) -> GenerateOutput:
        """One token-in / token-out generation (not streamed)."""
        params = sampling_params.to_json() if isinstance(sampling_params, SamplingParams) else dict(sampling_params)
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": params,
            "return_logprob": return_logprob,
            **extra,
        }
        if rid is not None:
            payload["rid"] = rid
        data = await self._post_json("/generate", payload, timeout=self._generate_timeout)
        if not isinstance(data, dict):
            raise EngineError(self.base_url, f"unexpected /generate answer: {str(data)[:200]}")
        try:
            return GenerateOutput.from_response(data)
        except (KeyError, TypeError, ValueError, IndexError) as e:  # a malformed answer is the engine's error
            raise EngineError(self.base_url, f"malformed /generate answer ({e!r}): {str(data)[:200]}") from e

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort requests whose id starts with `rid` (SGLang's prefix match), or all of them.
        The aborted `/generate` calls return their partial output with finish_reason abort."""
        if rid is None and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        await self._post_json("/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """`abort`: abort everything in flight; `retract`: requests go back to the queue (KV
        dropped, recomputed later); `in_place`: requests keep their KV. New requests wait until
        `continue_generation` in every mode."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        await self._post_json("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._post_json("/continue_generation", {})

    # ---- health and state -------------------------------------------------------------------

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        """True when the engine generates (SGLang runs a one-token request)."""
        try:
            await self._request("GET", "/health_generate", timeout_s=timeout_s)
        except EngineError:
            return False
        return True

    async def get_weight_version(self) -> str:
        """The engine's weight version: `/model_info`'s `weight_version` (0.5.23 http_server.py
        `model_info`; there is no `/get_weight_version` route)."""
        return str((await self.get_model_info())["weight_version"])

    async def get_model_info(self) -> dict[str, Any]:
        return (await self._request("GET", "/model_info")).json()

    async def get_server_info(self) -> dict[str, Any]:
        return (await self._request("GET", "/server_info")).json()

    async def flush_cache(self) -> bool:
        """False when the engine refuses because requests are in flight (SGLang's 400)."""
        try:
            await self._request("POST", "/flush_cache")
        except EngineUnavailableError:
            raise
        except EngineError as e:
            if e.status_code == 400:
                return False
            raise
        return True

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free KV cache and / or weights (`tags` in {"kv_cache", "weights"}); the engine must be
        idle. A no-op on the CPU engine."""
        await self._post_json("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._post_json("/resume_memory_occupation", {"tags": tags})

    # ---- weights ----------------------------------------------------------------------------

    async def begin_weight_update(self, selector: Literal["target", "draft", "all"] = "all") -> dict[str, Any]:
        """Open a weight-update session (0.5.23: tensor and distributed updates are refused
        outside one; a second begin is refused until `end_weight_update`)."""
        return await self._post_update("/begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> dict[str, Any]:
        """Close the session: the engine finalises the loaded weights (post-load processing)."""
        return await self._post_update("/end_weight_update", {})

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        return await self._post_update(
            "/update_weights_from_disk",
            {
                "model_path": model_path,
                "load_format": load_format,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests,
            },
        )

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """`serialized_named_tensors`: one payload per engine TP rank, from
        `weight_transfer.encode_sglang_flattened_payload` (SGLang, `load_format="flattened_bucket"`) or
        `weight_transfer.encode_safetensors_payload` (CPU engine, `load_format="safetensors"`)."""
        return await self._post_update(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": serialized_named_tensors,
                "load_format": load_format,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests,
            },
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Blocks until every rank (trainer rank 0 included) has joined the group."""
        return await self._post_update(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """Announce a broadcast; the trainer broadcasts the tensors (src 0) in `names` order
        while this call is pending."""
        return await self._post_update(
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests,
                "load_format": load_format,
            },
        )

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self._post_update("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> dict[str, Any]:
        return await self._post_update(
            "/update_weight_version", {"new_version": new_version, "abort_all_requests": abort_all_requests}
        )


def _error_message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
    return str(data)[:500]
