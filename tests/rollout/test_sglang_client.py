"""SGLang's own Python client (the `sglang` 0.5.23 frontend, `RuntimeEndpoint`; installed without its GPU
server stack by requirements-test.txt) against the CPU engine: `gen`, `select` (choices), `run_batch`
and native streaming, each checked against the engine's plain `/generate` answer or against a
reference forward of the model.

The client runs in a child process (this file run as a script): `import sglang` patches transformers
and sets cache environment variables process-wide, which must not leak into the other tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = ["What is 2+2?", "Name a colour.", "Why is the sky blue?", "Say hi."]
CHOICES = [" red", " green", " blue"]
PREFIX = "The colour is"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="the sglang client is a test dependency (requirements-test.txt)")


def _client_main(url: str) -> dict:
    """The child process: drive the engine with SGLang's frontend and report what it saw."""
    import warnings

    import sglang as sgl

    warnings.filterwarnings("ignore", message="Error in stream_executor")
    backend = sgl.RuntimeEndpoint(url)

    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=8, temperature=0, stop="\n")

    @sgl.function
    def pick(s):
        s += PREFIX
        s += sgl.select("colour", choices=CHOICES)

    @sgl.function
    def number(s):
        s += "A number:"
        s += sgl.gen("n", max_tokens=4, regex="[0-9]+")

    gen = qa.run(question=QUESTIONS[0], backend=backend)
    chosen = pick.run(backend=backend)
    batch = qa.run_batch([{"question": q} for q in QUESTIONS], backend=backend, num_threads=4)
    streamed = qa.run(question=QUESTIONS[2], backend=backend, stream=True)
    chunks = list(streamed.text_iter("answer"))
    refused = number.run(backend=backend)
    states = [gen, chosen, *batch, streamed]
    return {
        "errors": [None if s.error() is None else str(s.error()) for s in states],
        "gen": {"answer": gen["answer"], "meta": gen.get_meta_info("answer")},
        "choice": {"picked": chosen["colour"], "meta": chosen.get_meta_info("colour")},
        "batch": [s["answer"] for s in batch],
        "stream": {"chunks": chunks, "answer": streamed["answer"]},
        "refused": str(refused.error()),
    }


@pytest.fixture(scope="module")
def engine():
    from tests.rollout.engine_helpers import cpu_engine

    with cpu_engine() as server:
        yield server


@pytest.fixture(scope="module")
def seen(engine) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__, engine.url], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _plain(engine, question: str) -> dict:
    """What the engine answers to the same request sent by hand."""
    body = {"text": f"Q: {question}\nA:", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop": "\n"}}
    return httpx.post(engine.url + "/generate", json=body, timeout=60).json()


def test_no_client_call_failed(seen):
    assert seen["errors"] == [None] * len(seen["errors"])


def test_gen(engine, seen):
    plain = _plain(engine, QUESTIONS[0])
    assert seen["gen"]["answer"] == plain["text"]
    assert seen["gen"]["meta"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert seen["gen"]["meta"]["completion_tokens"] == len(plain["output_ids"])


def test_choices_pick_the_best_normalised_prompt_logprob(engine, seen):
    runner = engine.engine.runner
    prefix_len = len(runner.tokenizer.encode(PREFIX))
    expected = []
    for choice in CHOICES:
        tokens = runner.tokenizer.encode(PREFIX + choice)
        ref = runner.full_logprobs(tokens)
        start = max(prefix_len - 2, 0)  # RuntimeEndpoint.select's logprob_start_len (token healing)
        values = [float(ref[k - 1, tokens[k]]) for k in range(start + 1, len(tokens))]
        expected.append(sum(values) / len(values))
    assert seen["choice"]["meta"]["normalized_prompt_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert seen["choice"]["picked"] == CHOICES[max(range(len(CHOICES)), key=expected.__getitem__)]


def test_run_batch(engine, seen):
    assert seen["batch"] == [_plain(engine, q)["text"] for q in QUESTIONS]


def test_native_streaming(engine, seen):
    chunks = seen["stream"]["chunks"]
    assert len(chunks) > 1
    assert "".join(chunks) == seen["stream"]["answer"] == _plain(engine, QUESTIONS[2])["text"]


def test_constrained_decoding_is_refused_naming_the_field(seen):
    assert "regex" in seen["refused"] and "not supported by the CPU engine" in seen["refused"]


if __name__ == "__main__":
    print(json.dumps(_client_main(sys.argv[1])))
