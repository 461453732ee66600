"""The CPU engine accepts every field of sglang 0.5.23's `GenerateReqInput` and `SamplingParams`:
defaults pass silently, what it cannot honour is a 400 naming the field. The field lists are read
from the installed `sglang` package (requirements-test.txt), so a field SGLang adds is noticed."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sao.cpu_engine.sampling_params import SAMPLING_FIELDS
from megatron_sao.cpu_engine.surface import GENERATE_FIELDS
from tests.rollout.engine_helpers import cpu_engine

_SPEC = importlib.util.find_spec("sglang")  # located, not imported: `import sglang` patches transformers
pytestmark = pytest.mark.skipif(_SPEC is None, reason="sglang is a test dependency (requirements-test.txt)")


@pytest.fixture(scope="module")
def engine():
    with cpu_engine() as server:
        yield server


def _class_defaults(module: str, name: str) -> dict[str, object]:
    """The annotated fields of class `name` in sglang's `module` (a path under the package) and their
    literal defaults (None where the default is not a literal), read from its source: importing
    io_struct needs SGLang's GPU server stack."""
    assert _SPEC is not None and _SPEC.origin is not None
    source = Path(_SPEC.origin).parent.joinpath(*module.split("/"))
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            defaults: dict[str, object] = {}
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    value = stmt.value
                    if isinstance(value, ast.Call):  # field(default=..., kw_only=True)
                        value = next((k.value for k in value.keywords if k.arg == "default"), None)
                    try:
                        defaults[stmt.target.id] = ast.literal_eval(value) if value is not None else None
                    except ValueError:
                        defaults[stmt.target.id] = None
            return defaults
    raise AssertionError(f"{name} not found in sglang's {module}")


def _generate_req_input_defaults() -> dict[str, object]:
    return _class_defaults("srt/managers/io_struct.py", "GenerateReqInput")


def _sampling_params_defaults() -> dict[str, object]:
    return _class_defaults("srt/sampling/sampling_params.py", "SamplingParams")


def _post(engine, body) -> httpx.Response:
    return httpx.post(engine.url + "/generate", json=body, timeout=60)


def test_every_sglang_field_is_known():
    assert set(_generate_req_input_defaults()) <= GENERATE_FIELDS
    assert set(_sampling_params_defaults()) <= SAMPLING_FIELDS


def test_every_request_field_at_its_sglang_default_passes(engine):
    body = {k: v for k, v in _generate_req_input_defaults().items() if k not in ("text", "input_ids")}
    body.update(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "temperature": 0.0}, rid="defaults")
    response = _post(engine, body)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] == 2


def test_every_sampling_field_at_its_sglang_default_passes(engine):
    params = {k: v for k, v in _sampling_params_defaults().items()
              if isinstance(v, (int, float, str, bool, type(None)))}
    params.update(max_new_tokens=2)
    response = _post(engine, {"input_ids": [5, 6, 7], "sampling_params": params})
    assert response.status_code == 200, response.text
    assert len(response.json()["output_ids"]) == 2


@pytest.mark.parametrize(
    "body, field",
    [
        ({"sampling_params": {"json_schema": '{"type": "object"}'}}, "json_schema"),
        ({"sampling_params": {"regex": "a+"}}, "regex"),
        ({"sampling_params": {"ebnf": "root ::= 'a'"}}, "ebnf"),
        ({"sampling_params": {"structural_tag": "{}"}}, "structural_tag"),
        ({"sampling_params": {"beam_width": 4}}, "beam_width"),
        ({"lora_path": "adapter"}, "lora_path"),
        ({"custom_logit_processor": "serialized"}, "custom_logit_processor"),
        ({"image_data": "http://x/y.png"}, "image_data"),
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"routed_dp_rank": 1}, "routed_dp_rank"),
        ({"session_params": {"id": "s"}}, "session_params"),
        ({"bogus_field": 1}, "bogus_field"),
        ({"sampling_params": {"bogus": 1}}, "bogus"),
        ({"sampling_params": {"frequency_penalty": 2.5}}, "frequency_penalty"),
        ({"sampling_params": {"repetition_penalty": 0.0}}, "repetition_penalty"),
        ({"sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "min_new_tokens"),
        ({"sampling_params": {"stop_regex": "(unclosed"}}, "stop_regex"),
        ({"sampling_params": {"stop_regex": "a" * 300}}, "stop_regex"),
        ({"sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"sampling_params": {"logit_bias": {"99999": 1.0}}}, "logit_bias"),
        ({"logprob_start_len": 9, "return_logprob": True}, "logprob_start_len"),
        ({"token_ids_logprob": [99999], "return_logprob": True}, "token_ids_logprob"),
        ({"top_logprobs_num": -1, "return_logprob": True}, "top_logprobs_num"),
        ({"session_id": 7}, "session_id"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(engine, body, field):
    response = _post(engine, {"input_ids": [5, 6, 7], **body})
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


def test_metadata_fields_are_accepted(engine):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}, "session_id": "s1", "priority": 3,
            "custom_labels": {"team": "rl"}, "routing_key": "k", "conversation_id": "c", "extra_key": "e",
            "cache_salt": "salt", "external_trace_header": {}, "received_time": 1.5, "log_metrics": False,
            "no_logs": True, "routed_dp_rank": 0}
    assert _post(engine, body).status_code == 200


def test_return_prompt_token_ids(engine):
    answer = _post(engine, {"text": "hi", "sampling_params": {"max_new_tokens": 1},
                            "return_prompt_token_ids": True}).json()
    assert answer["prompt_token_ids"] == engine.engine.runner.tokenizer.encode("hi")



# ---- random values of the new fields never get a 5xx --------------------------------------------

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 40) | st.floats(allow_nan=True) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
_sampling = st.dictionaries(
    st.sampled_from(["stop", "stop_regex", "frequency_penalty", "presence_penalty", "repetition_penalty",
                     "min_new_tokens", "n", "logit_bias", "stream_interval", "no_stop_trim", "custom_params",
                     "beam_width", "temperature"]),
    _values, max_size=4)
_request = st.dictionaries(
    st.sampled_from(["return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "stream",
                     "return_text_in_logprobs", "return_prompt_token_ids", "lora_path", "session_id"]),
    _values, max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sampling=_sampling, request=_request)
def test_random_new_surface_values_get_200_or_400(engine, sampling, request):
    body = {"input_ids": [5, 6, 7, 8], **request, "sampling_params": {**sampling, "max_new_tokens": 3}}
    response = httpx.post(engine.url + "/generate", content=json.dumps(body, allow_nan=True).encode(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code in (200, 400), (body, response.status_code, response.text[:300])
    if response.status_code == 400:
        assert response.json()["error"]["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line]
        assert events[-1] == "[DONE]" and all("meta_info" in json.loads(e) for e in events[:-1])
    else:
        answers = response.json()
        assert all(len(a["output_ids"]) <= 3 for a in (answers if isinstance(answers, list) else [answers]))
