"""The CPU engine's weight endpoints: SGLang's refit API (from disk, from tensor, from a
distributed group), the weight-update session and `update_weight_version`.

Request and response bodies follow SGLang 0.5.23's `UpdateWeightFromDiskReqInput`,
`UpdateWeightsFromTensorReqInput`, `InitWeightsUpdateGroupReqInput`,
`UpdateWeightsFromDistributedReqInput`, `BeginWeightUpdateReqInput`, `EndWeightUpdateReqInput`,
`UpdateWeightVersionReqInput` and `GetWeightsByNameReqInput` (the readback, by HF name)
(`managers/io_struct.py`). Every update is validated in full (names, shapes) before the first
tensor is written, then applied on the scheduler thread between two decode steps;
`weight_version` (when given) changes with it.

What 0.5.23 enforces, enforced here (`managers/scheduler_components/weight_updater.py`):
- tensor and distributed updates run only inside a session opened by `/begin_weight_update` and
  closed by `/end_weight_update` (400 with SGLang's message otherwise); disk updates need none;
  a second begin, or an end without a begin, is refused;
- `flush_cache` (default true) after an update fails the call unless the engine is idle
  (`flush_cache_after_weight_update`: the weights are loaded, the cache is not flushed); there
  is no prefix cache to flush, so nothing else happens;
- loading into released weights stops the engine (occupation.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from megatron_sao.cpu_engine.occupation import EngineFatal
from megatron_sao.cpu_engine.weights import read_hf_checkpoint
from megatron_sao.rollout.ipc_payload import TORCH_IPC_LOAD_FORMAT, decode_torch_ipc_payload
from megatron_sao.rollout.weight_transfer import (
    DEFAULT_GROUP_NAME,
    SAFETENSORS_LOAD_FORMAT,
    create_weight_update_group,
    decode_safetensors_payload,
    parse_dtype_name,
)


class WeightRouteEngine(Protocol):
    """The engine state the weight routes use (`server.CPUEngine` has it; typed here so that this
    module does not import the server that registers it)."""

    groups: Any
    occupation: Any
    runner: Any
    scheduler: Any
    server: Any
    weight_session: Any
    weights: Any


NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or queued. "
               "Retract or finish them, then call /flush_cache.")  # 0.5.23 flush_cache_after_weight_update


def outside_session(route: str) -> str:
    """0.5.23's refusal of a tensor / distributed update without an open session."""
    return f"{route} must run between begin_weight_update() and end_weight_update()"


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


async def _body(http: Request) -> dict[str, Any]:
    raw = await http.body()
    data = await http.json() if raw else {}
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    return data


def register_weight_routes(
    app: FastAPI, engine: WeightRouteEngine, on_scheduler: Callable[[Callable[[], Any]], Awaitable[Any]]
) -> None:
    sched = engine.scheduler

    async def apply(named: dict[str, torch.Tensor], body: dict[str, Any]) -> tuple[bool, str]:
        if body.get("abort_all_requests"):
            await on_scheduler(lambda: sched.abort(abort_all=True, message="Abort by weight update"))
        version = body.get("weight_version")
        try:
            await on_scheduler(lambda: sched.apply_weights(named, None if version is None else str(version)))
        except (ValueError, NotImplementedError) as e:
            return False, str(e)
        if body.get("flush_cache", True) and not await on_scheduler(sched.fully_idle):
            return False, NOT_FLUSHED
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return True, message

    async def fatal_or(result: Awaitable[tuple[bool, str]]) -> JSONResponse:
        """A load into released weights stops the engine (as SGLang crashes): 500."""
        try:
            return _result(*await result)
        except EngineFatal as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=500)

    @app.post("/begin_weight_update")
    async def begin_weight_update(http: Request):
        selector = (await _body(http)).get("selector", "all")
        if selector not in ("target", "draft", "all"):
            raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
        if engine.weight_session is not None:
            return _result(False, "a weight-update session is already open; call end_weight_update() first")
        engine.weight_session = selector
        return _result(True, "Success")

    @app.post("/end_weight_update")
    async def end_weight_update(http: Request):
        await _body(http)
        if engine.weight_session is None:
            return _result(False, "no weight-update session is open; call begin_weight_update() first")
        engine.weight_session = None
        return _result(True, "Success")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(http: Request):
        try:
            body = await _body(http)
            if body.get("load_format") not in (None, "auto", "safetensors"):
                raise ValueError(f"load_format {body['load_format']!r} is not supported by the CPU engine")
            if not body.get("model_path"):
                raise ValueError("model_path is required")
            named = await asyncio.to_thread(read_hf_checkpoint, str(body["model_path"]))
            missing = sched.weight_map.missing_from(named)
            if missing:
                raise ValueError(f"the checkpoint lacks {len(missing)} model tensor(s), e.g. {missing[:5]}")
        except ValueError as e:
            return _result(False, str(e), num_paused_requests=0)
        try:
            ok, message = await apply(named, body)
        except EngineFatal as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=500)
        if ok:
            engine.runner.model_path = str(body["model_path"])
        return _result(ok, message, num_paused_requests=0)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(http: Request):
        try:
            body = await _body(http)
            if engine.weight_session is None:
                return _result(False, outside_session("update_weights_from_tensor"))
            decode = {SAFETENSORS_LOAD_FORMAT: decode_safetensors_payload,
                      TORCH_IPC_LOAD_FORMAT: decode_torch_ipc_payload}.get(body.get("load_format"))
            if decode is None:
                raise ValueError(
                    "the CPU engine reads load_format='safetensors' payloads only (SGLang's default payload "
                    "carries CUDA IPC handles); build them with "
                    "megatron_sao.rollout.weight_transfer.encode_safetensors_payload (or, on a CUDA machine, "
                    "load_format='torch_ipc': megatron_sao.rollout.ipc_payload)"
                )
            payloads = body.get("serialized_named_tensors") or []
            if len(payloads) != 1:
                raise ValueError(f"the CPU engine has one TP rank and takes one payload, got {len(payloads)}")
            named = await asyncio.to_thread(decode, payloads[0])
        except ValueError as e:
            return _result(False, str(e))
        return await fatal_or(apply(named, body))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(http: Request):
        try:
            body = await _body(http)
            name = str(body.get("group_name", DEFAULT_GROUP_NAME))
            if name in engine.groups:
                raise ValueError(f"weight update group {name!r} already exists")
            group = await asyncio.to_thread(
                create_weight_update_group,
                str(body["master_address"]),
                int(body["master_port"]),
                int(body["rank_offset"]),
                int(body["world_size"]),
                name,
                str(body.get("backend", "nccl")),
            )
        except (KeyError, TypeError, ValueError, NotImplementedError, RuntimeError) as e:  # mistyped fields: 400
            return _result(False, f"init_weights_update_group failed: {e}")
        engine.groups[name] = group
        return _result(True, "Succeeded to initialize custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(http: Request):
        try:
            body = await _body(http)
            if engine.weight_session is None:
                return _result(False, outside_session("update_weights_from_distributed"))
            group = engine.groups.get(str(body.get("group_name", DEFAULT_GROUP_NAME)))
            if group is None:
                raise ValueError(f"no weight update group {body.get('group_name', DEFAULT_GROUP_NAME)!r}")
            if body.get("load_format") is not None:
                raise ValueError("load_format is not supported for distributed updates by the CPU engine")
            names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
            if not len(names) == len(dtypes) == len(shapes):
                raise ValueError("names, dtypes and shapes differ in length")
            buffers = [torch.empty(s, dtype=parse_dtype_name(d)) for d, s in zip(dtypes, shapes, strict=True)]
            named = dict(zip(names, buffers, strict=True))
            sched.weight_map.check(named)
        except (KeyError, TypeError, ValueError, NotImplementedError) as e:  # mistyped fields: 400
            return _result(False, str(e))

        def receive() -> None:  # off the scheduler thread: generation goes on while bytes arrive
            for buffer in buffers:
                group.broadcast(buffer, 0).wait()

        try:
            await asyncio.to_thread(receive)
        except RuntimeError as e:
            return _result(False, f"broadcast failed: {e}")
        return await fatal_or(apply(named, body))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(http: Request):
        body = await _body(http)
        if engine.groups.pop(str(body.get("group_name", DEFAULT_GROUP_NAME)), None) is None:
            return _result(False, "no such weight update group")
        return _result(True, "Succeeded to destroy custom process group.")

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(http: Request):
        """sglang 0.5.23's readback (`GetWeightsByNameReqInput`: name, truncate_size=100; the answer is
        the tensor's first `truncate_size` rows as float32 lists, `models/llama.py`
        `get_weights_by_name`), by HF checkpoint name."""
        body = await _body(http)
        view = sched.weight_map.views.get(str(body.get("name")))
        if view is None:
            return JSONResponse({"error": {"message": f"Get parameter by name failed: no tensor {body.get('name')!r}"}},
                                status_code=400)
        rows = int(body.get("truncate_size", 100))
        return JSONResponse(await on_scheduler(lambda: view.detach()[:rows].to(torch.float32).tolist()))

    @app.post("/update_weight_version")
    async def update_weight_version(http: Request):
        body = await _body(http)
        if "new_version" not in body:
            return _result(False, "new_version is required")
        new_version = str(body["new_version"])
        if body.get("abort_all_requests", True):
            await on_scheduler(lambda: sched.abort(abort_all=True, message="Abort by update_weight_version"))
        await on_scheduler(lambda: setattr(sched, "weight_version", new_version))
        return JSONResponse(
            {
                "success": True,
                "message": f"Weight version updated to {new_version}",
                "new_version": body["new_version"],
            }
        )
