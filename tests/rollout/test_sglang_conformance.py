"""The engine client, weight sync and engine launcher against sglang 0.5.23's own definitions
(tests/rollout/sglang_contract.py reads them from the installed package in a subprocess):

- every call `EngineClient` makes is a route of sglang's FastAPI app (path + method) and its body
  validates with that route's own request class, with no key the class does not declare;
- a weight push (tensor and distributed modes, recorded against the CPU engine) opens a
  `begin_weight_update` session before its first update and closes it after the last, on every
  engine, as 0.5.23's scheduler requires;
- the version is read from `/model_info`'s `weight_version`, a key sglang's `/model_info` has; the
  CPU engine's `/model_info` answers every key sglang's does, and it has no `/get_weight_version`;
- the SGLang command lines the launcher builds parse with sglang's `prepare_server_args` into the
  layout asked for (DP attention as `--attn-dp-size` with one replica, multi-node parts, memory
  saver, base GPU).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from megatron_sao.config.loader import load_config
from megatron_sao.config.schema import WeightSyncConfig
from megatron_sao.pipeline.weight_sync import WeightSync
from megatron_sao.rollout.client import EngineClient, SamplingParams
from megatron_sao.rollout.engine_supervisor import EngineSupervisor
from megatron_sao.rollout.settings import engine_config_from
from tests.pipeline.test_weight_sync import CheckpointExporter
from tests.rollout.engine_helpers import cpu_engine, tiny_checkpoint, tiny_checkpoint_other_seed

REPO = Path(__file__).resolve().parents[2]
SESSION_UPDATES = ("/update_weights_from_tensor", "/update_weights_from_distributed")

pytest.importorskip("sglang", reason="requirements-test.txt installs sglang 0.5.23 (--no-deps)")


class RecordingClient(EngineClient):
    """An `EngineClient` whose every HTTP request is recorded (method, path, JSON body)."""

    def __init__(self, base_url: str, log: list[dict[str, Any]], transport: httpx.AsyncBaseTransport | None = None,
                 **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.log, self.transport = log, transport

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            async def record(request: httpx.Request) -> None:
                body = json.loads(request.content) if request.content else None
                self.log.append({"engine": self.base_url, "method": request.method, "path": request.url.path,
                                 "body": body})

            self._client = httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout, limits=self._limits,
                                             transport=self.transport, event_hooks={"request": [record]})
            self._client_loop = loop
        return self._client


def _sglang_answers(request: httpx.Request) -> httpx.Response:
    """What 0.5.23 answers, in shape (http_server.py): enough for the client to parse."""
    path = request.url.path
    if path == "/generate":
        return httpx.Response(200, json={"text": "", "output_ids": [5], "meta_info": {
            "id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 2, "completion_tokens": 1,
            "weight_version": "3", "output_token_logprobs": [[-0.5, 5, None]]}})
    if path in ("/model_info", "/server_info"):
        return httpx.Response(200, json={"weight_version": "3", "model_path": "/m"})
    if path in ("/health_generate", "/flush_cache", "/abort_request"):
        return httpx.Response(200)
    if path in ("/release_memory_occupation", "/resume_memory_occupation"):
        return httpx.Response(200, json=None)
    return httpx.Response(200, json={"success": True, "message": "Success"})


# One call per public coroutine of EngineClient (a new one must be added here to be checked).
CLIENT_CALLS: dict[str, Any] = {
    "generate": lambda c: c.generate([1, 2, 3], SamplingParams(max_new_tokens=4, stop=["x"], sampling_seed=1),
                                     rid="r1"),
    "abort_request": lambda c: c.abort_request(rid="r1"),
    "pause_generation": lambda c: c.pause_generation("retract"),
    "continue_generation": lambda c: c.continue_generation(),
    "health_generate": lambda c: c.health_generate(),
    "get_weight_version": lambda c: c.get_weight_version(),
    "get_model_info": lambda c: c.get_model_info(),
    "get_server_info": lambda c: c.get_server_info(),
    "flush_cache": lambda c: c.flush_cache(),
    "release_memory_occupation": lambda c: c.release_memory_occupation(),
    "resume_memory_occupation": lambda c: c.resume_memory_occupation(["weights"]),
    "begin_weight_update": lambda c: c.begin_weight_update(),
    "end_weight_update": lambda c: c.end_weight_update(),
    "update_weights_from_disk": lambda c: c.update_weights_from_disk("/ckpt/v3", weight_version="3"),
    "update_weights_from_tensor": lambda c: c.update_weights_from_tensor(["aGVsbG8="], load_format="flattened_bucket",
                                                                         flush_cache=False),
    "init_weights_update_group": lambda c: c.init_weights_update_group("10.0.0.1", 29500, 1, 3),
    "update_weights_from_distributed": lambda c: c.update_weights_from_distributed(
        ["model.embed_tokens.weight"], ["bfloat16"], [[8, 4]], flush_cache=False),
    "destroy_weights_update_group": lambda c: c.destroy_weights_update_group(),
    "update_weight_version": lambda c: c.update_weight_version("3", abort_all_requests=False),
}


def _client_requests() -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = []
    client = RecordingClient("http://sglang.test", log, transport=httpx.MockTransport(_sglang_answers))

    async def go() -> None:
        for name, call in CLIENT_CALLS.items():
            before = len(log)
            try:
                await call(client)
                error = None
            except Exception as e:  # judged below, with the request that caused it
                error = repr(e)
            for entry in log[before:]:
                entry["call"], entry["error"] = name, error

    asyncio.run(go())
    return log


def _push_requests() -> list[dict[str, Any]]:
    """Tensor and distributed pushes (two versions each) into two real CPU engines."""
    log: list[dict[str, Any]] = []
    exporter = CheckpointExporter(tiny_checkpoint_other_seed())
    with cpu_engine() as a, cpu_engine() as b:
        for mode in ("tensor", "distributed"):
            async def go(mode: str = mode) -> None:
                clients = [RecordingClient(a.url, log), RecordingClient(b.url, log)]
                sync = WeightSync(exporter, WeightSyncConfig(mode=mode, bucket_mb=0.2), timeout_s=60)
                for version in (1, 2):
                    await sync.push(clients, version)
                await sync.close_group(clients)

            asyncio.run(go())
    return log


def _sglang_command_lines() -> list[list[str]]:
    """What the launcher runs for two shipped recipes: a disaggregated DeepSeek-V3 engine part
    (TP 16 over two nodes, DP attention 16) and the 30B-A3B engines made colocated."""
    model = str(tiny_checkpoint())
    deepseek = engine_config_from(load_config(str(REPO / "recipes/deepseek_v3_671b_math_sao.yaml"), []), model)
    part = dataclasses.replace(deepseek, num_engines=1, nnodes=2, node_rank=1, dist_init_addr="10.0.0.7:24004")
    colocated = engine_config_from(load_config(str(REPO / "recipes/qwen3_30b_a3b_math_sao.yaml"), [
        "launcher.nnodes=1", "parallelism.world_size=8", "parallelism.expert=8", "parallelism.context=1",
        "rollout.num_engines=4"]), model)
    disaggregated = engine_config_from(load_config(str(REPO / "recipes/qwen3_30b_a3b_math_sao.yaml"), [
        "launcher.nnodes=1", "parallelism.world_size=4", "parallelism.expert=4", "parallelism.context=1",
        "rollout.num_engines=2", "launcher.ray=false"]), model)
    return [EngineSupervisor(part).command(0, 30000)[3:], EngineSupervisor(colocated).command(1, 30001)[3:],
            EngineSupervisor(disaggregated).command(1, 30002)[3:]]


@pytest.fixture(scope="module")
def checked() -> dict[str, Any]:
    """Everything recorded here, judged by sglang's own definitions in one subprocess."""
    client_log, push_log, argv = _client_requests(), _push_requests(), _sglang_command_lines()
    job = {"requests": [*client_log, *push_log], "server_args": argv}
    done = subprocess.run([sys.executable, "-m", "tests.rollout.sglang_contract"], input=json.dumps(job),
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout)
    assert answer["version"] == "0.5.23"
    n = len(client_log)
    return {"client": list(zip(client_log, answer["requests"][:n], strict=True)),
            "push": list(zip(push_log, answer["requests"][n:], strict=True)), "answer": answer}


def test_every_client_call_is_a_route_of_sglang_with_a_body_it_accepts(checked):
    public = {name for name, fn in inspect.getmembers(EngineClient, inspect.iscoroutinefunction)
              if not name.startswith("_") and name != "close"}
    assert public == set(CLIENT_CALLS), f"check these calls too: {sorted(public ^ set(CLIENT_CALLS))}"
    assert {entry["call"] for entry, _ in checked["client"]} == public  # each one made a request
    for entry, verdict in checked["client"] + checked["push"]:
        what = f"{entry['method']} {entry['path']} ({entry.get('call', 'weight push')})"
        assert verdict["route"], f"{what}: no such route in sglang 0.5.23"
        assert entry.get("error") is None, f"{what}: the client could not read 0.5.23's answer: {entry['error']}"
        assert not verdict["errors"], f"{what}: sglang's {verdict.get('body_class')} refuses {entry['body']}: " \
                                      f"{verdict['errors']}"
        assert not verdict["unknown_keys"], f"{what}: {verdict['unknown_keys']} not in {verdict.get('body_class')}"


def test_weight_updates_run_inside_a_session_on_every_engine(checked):
    by_engine: dict[str, list[str]] = {}
    for entry, _ in checked["push"]:
        by_engine.setdefault(entry["engine"], []).append(entry["path"])
    assert len(by_engine) == 2
    for engine, paths in by_engine.items():
        open_session, sessions, updates = False, 0, 0
        for path in paths:
            if path == "/begin_weight_update":
                assert not open_session, f"{engine}: begin inside an open session: {paths}"
                open_session, sessions = True, sessions + 1
            elif path == "/end_weight_update":
                assert open_session, f"{engine}: end without a session: {paths}"
                open_session = False
            elif path in SESSION_UPDATES:
                assert open_session, f"{engine}: {path} outside a begin/end session: {paths}"
                updates += 1
        assert not open_session and sessions == 4 and updates >= 4  # 2 modes x 2 versions


def test_the_version_comes_from_model_info_which_the_cpu_engine_answers_in_full(checked):
    keys = checked["answer"]["model_info_keys"]
    assert "weight_version" in keys
    version_reads = [e for e, _ in checked["client"] if e["call"] == "get_weight_version"]
    assert [(e["method"], e["path"]) for e in version_reads] == [("GET", "/model_info")]
    assert "GET /get_weight_version" not in checked["answer"]["routes"]
    with cpu_engine() as server:
        info = httpx.get(f"{server.url}/model_info").json()
        missing = httpx.get(f"{server.url}/get_weight_version")
    assert set(keys) <= set(info) and info["weight_version"] == "0"
    assert missing.status_code == 404


def test_engine_command_lines_parse_with_sglangs_server_args(checked):
    part, colocated, disaggregated = checked["answer"]["server_args"]
    # DeepSeek-V3's engine: one replica of TP 16 with DP attention 16 (0.5.23 refuses weight
    # updates for --dp-size > 1), node 1 of 2 meeting at node 0
    assert (part["tp_size"], part["ep_size"], part["attn_dp_size"], part["dp_size"]) == (16, 16, 16, 1)
    assert (part["nnodes"], part["node_rank"], part["dist_init_addr"]) == (2, 1, "10.0.0.7:24004")
    assert part["enable_memory_saver"] is False
    # colocated engines release memory only with the memory saver; engine 1 of TP 2 on GPUs 2-3
    assert colocated["enable_memory_saver"] is True and colocated["base_gpu_id"] == 2
    # disaggregated, outside Ray: engines start after the 4 trainer GPUs of the node
    assert disaggregated["base_gpu_id"] == 4 + 2 and disaggregated["enable_memory_saver"] is False
