"""sglang 0.5.23's own definitions of its HTTP protocol, read in a process of their own
(`python -m tests.rollout.sglang_contract < job.json > answer.json`) for the conformance test.

What it reads, all from the installed sglang package (requirements-test.txt pins it, installed
without its GPU dependencies):
- the routes (path + methods) of its FastAPI app, `sglang.srt.entrypoints.http_server.app`;
- each request body, validated by the route's own body field (FastAPI's validation of that route:
  the `io_struct` class, e.g. `UpdateWeightsFromTensorReqInput`), plus the keys that class does
  not declare (its schema would ignore them silently: a misspelt field);
- the keys `/model_info` answers with (the dict literal in `http_server.model_info`);
- `prepare_server_args` on engine command lines (sglang's own argument parser and resolution).

Shim (the only one): `soundfile` is stubbed. sglang's app imports it for audio input; the wheel
needs libsndfile through cffi, neither of which the test environment has, and no route used here
touches audio. Everything else the app imports is installed (requirements-test.txt).

It runs in a subprocess because importing sglang patches transformers process-wide
(`sglang/__init__.py`: `hf_transformers_patches.apply_all`) and imports a few hundred modules.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.abc
import importlib.machinery
import inspect
import json
import sys
import textwrap
import types
from typing import Any


class _StubAudio(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name.split(".")[0] == "soundfile" else None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module) -> None:
        pass


def _model_info_keys(http_server: Any) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(http_server.model_info)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            return [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    raise RuntimeError("no dict literal in http_server.model_info")


def _check_request(routes: dict[tuple[str, str], Any], request: dict[str, Any]) -> dict[str, Any]:
    import msgspec

    route = routes.get((request["path"], request["method"]))
    if route is None:
        return {"route": False, "errors": [], "unknown_keys": []}
    field = route.body_field
    if field is None:
        return {"route": True, "errors": [], "unknown_keys": []}
    body = request.get("body")
    _, errors = field.validate(body if body is not None else {}, {}, loc=("body",))
    cls = field.field_info.annotation
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        known = {f.name for f in msgspec.structs.fields(cls)}
    elif dataclasses.is_dataclass(cls):  # GenerateReqInput
        known = {f.name for f in dataclasses.fields(cls)}
    else:
        known = set()
    unknown = sorted(set(body or {}) - known) if known else []
    return {"route": True, "errors": [str(e.get("msg", e)) + f" at {e.get('loc')}" for e in errors or []],
            "unknown_keys": unknown, "body_class": getattr(cls, "__name__", str(cls))}


def _server_args(argv: list[str]) -> dict[str, Any]:
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    view = resolving_view(prepare_server_args(argv))
    names = ("tp_size", "ep_size", "dp_size", "attn_dp_size", "pp_size", "base_gpu_id", "enable_memory_saver",
             "nnodes", "node_rank", "dist_init_addr", "weight_version", "random_seed", "mem_fraction_static",
             "context_length", "port", "host", "skip_server_warmup")
    return {n: getattr(view, n) for n in names}


def main() -> int:
    job = json.load(sys.stdin)
    sys.meta_path.insert(0, _StubAudio())
    import sglang
    import sglang.srt.entrypoints.http_server as http_server
    from fastapi.routing import APIRoute

    routes = {}
    for route in http_server.app.routes:
        if isinstance(route, APIRoute):
            for method in route.methods:
                routes[(route.path, method)] = route
    answer = {
        "version": sglang.__version__,
        "routes": sorted(f"{m} {p}" for p, m in routes),
        "model_info_keys": _model_info_keys(http_server),
        "requests": [_check_request(routes, r) for r in job.get("requests", [])],
        "server_args": [_server_args(argv) for argv in job.get("server_args", [])],
    }
    json.dump(answer, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
