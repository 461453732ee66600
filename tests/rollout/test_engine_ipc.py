"""The CPU engine's readback (`/get_weights_by_name`, sglang 0.5.23's route, by HF name) and its
CUDA-IPC payload (`load_format="torch_ipc"`, rollout/ipc_payload.py): refused with a reason where
it cannot work (malformed, no CUDA here), and, on a GPU, a weight update by IPC handles from
another process lands bit for bit (gpu-marked; tools/gpu_check.sh check c runs the same path)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from safetensors.torch import load_file

from megatron_sao.rollout.ipc_payload import TORCH_IPC_LOAD_FORMAT, _entries, decode_torch_ipc_payload
from tests.rollout.engine_helpers import cpu_engine, tiny_checkpoint

NAME = "model.layers.1.mlp.experts.2.up_proj.weight"


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=60)


def test_get_weights_by_name_reads_back_checkpoint_rows() -> None:
    expected = load_file(str(tiny_checkpoint() / "model.safetensors"))
    with cpu_engine() as server:
        rows = _post(server.url, "/get_weights_by_name", {"name": NAME, "truncate_size": 3})
        whole = _post(server.url, "/get_weights_by_name", {"name": "model.norm.weight"})
        unknown = _post(server.url, "/get_weights_by_name", {"name": "model.not_a_weight"})
    assert rows.status_code == 200
    assert torch.equal(torch.tensor(rows.json(), dtype=torch.float32), expected[NAME][:3].float())
    assert torch.equal(torch.tensor(whole.json()), expected["model.norm.weight"].float())  # 1-D: all of it
    assert unknown.status_code == 400 and "model.not_a_weight" in unknown.json()["error"]["message"]


def _valid_entry(**changes) -> dict:
    entry = {"name": NAME, "dtype": "bfloat16", "size": [2, 3], "stride": [3, 1], "offset": 0, "device": 0,
             "handle": base64.b64encode(b"h").decode(), "storage_bytes": 12, "storage_offset_bytes": 0,
             "ref_counter_handle": base64.b64encode(b"r").decode(), "ref_counter_offset": 0,
             "event_handle": None, "event_sync_required": True}
    return {**entry, **changes}


@pytest.mark.parametrize(("payload", "message"), [
    ("{not json", "JSON expected"),
    (json.dumps({"name": NAME}), "a JSON list"),
    (json.dumps([_valid_entry(offset="0")]), "field 'offset'"),
    (json.dumps([_valid_entry(size=None)]), "field 'size'"),
    (json.dumps([_valid_entry(dtype="float99")]), "unknown dtype 'float99'"),
    (json.dumps([{k: v for k, v in _valid_entry().items() if k != "handle"}]), "field 'handle'"),
])
def test_malformed_torch_ipc_payloads_are_refused_naming_the_field(payload: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _entries(payload)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_torch_ipc_without_cuda_is_refused_and_nothing_changes() -> None:
    payload = json.dumps([_valid_entry()])
    with pytest.raises(ValueError, match="no CUDA device"):
        decode_torch_ipc_payload(payload)
    with cpu_engine() as server:
        _post(server.url, "/begin_weight_update", {"selector": "all"})  # 404 on an engine without sessions
        answer = _post(server.url, "/update_weights_from_tensor",
                       {"serialized_named_tensors": [payload], "load_format": TORCH_IPC_LOAD_FORMAT})
        after = _post(server.url, "/get_weights_by_name", {"name": NAME, "truncate_size": 2}).json()
    assert answer.status_code == 400 and "no CUDA device" in answer.json()["message"]
    expected = load_file(str(tiny_checkpoint() / "model.safetensors"))[NAME][:2].float()
    assert torch.equal(torch.tensor(after), expected)


@pytest.mark.gpu
def test_a_weight_update_by_cuda_ipc_from_another_process_lands_bit_for_bit(tmp_path) -> None:
    """The engine runs in this process; the sender is a fresh process holding the CUDA tensors."""
    expected = load_file(str(tiny_checkpoint() / "model.safetensors"))
    update = {name: torch.randn_like(expected[name]) for name in (NAME, "model.norm.weight")}
    torch.save(update, tmp_path / "update.pt")
    with cpu_engine() as server:
        sender = textwrap.dedent(f"""
            import httpx, torch
            from megatron_sao.rollout.ipc_payload import encode_torch_ipc_payload
            update = {{k: v.cuda() for k, v in torch.load({str(tmp_path / 'update.pt')!r}).items()}}
            payload, keep = encode_torch_ipc_payload(update)
            url = {server.url!r}
            httpx.post(url + "/begin_weight_update", json={{"selector": "all"}})
            r = httpx.post(url + "/update_weights_from_tensor", timeout=120, json={{
                "serialized_named_tensors": [payload], "load_format": "torch_ipc", "flush_cache": False}})
            httpx.post(url + "/end_weight_update", json={{}})
            assert r.status_code == 200, r.text
        """)
        subprocess.run([sys.executable, "-c", sender], check=True, timeout=300)
        got = {n: _post(server.url, "/get_weights_by_name", {"name": n, "truncate_size": 10**6}).json()
               for n in update}
    for name, tensor in update.items():
        assert torch.equal(torch.tensor(got[name], dtype=torch.float32), tensor.float()), name
