"""The HTTP reward model client against a real server on 127.0.0.1 (retries, timeouts, errors)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_sao.rollout.environment import PromptSample
from megatron_sao.rollout.rewards import RemoteRewardError, RemoteRewardModel, RewardInput, SafeReward


class _Handler(BaseHTTPRequestHandler):
    """Behaviour by path: /score, /flaky (503 twice), /slow, /bad-request, /not-json, /no-field."""

    server: _Server

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append((self.path, body))
            count = sum(1 for path, _ in self.server.requests if path == self.path)
        if self.path == "/flaky" and count <= 2:
            return self._send(503, b"busy")
        if self.path == "/slow":
            time.sleep(1.0)
        if self.path == "/bad-request":
            return self._send(400, b"missing field")
        if self.path == "/not-json":
            return self._send(200, b"<html>")
        if self.path == "/no-field":
            return self._send(200, b'{"score": 1}')
        reward = 1.0 if body["response"].strip() == body["answer"] else 0.0
        return self._send(200, json.dumps({"reward": reward}).encode())

    def _send(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the client hanging up on /slow is the point of that test

    def count(self, path: str) -> int:
        with self.lock:
            return sum(1 for p, _ in self.requests if p == path)


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv: _Server, path: str) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}{path}"


def _inp(response: str) -> RewardInput:
    sample = PromptSample(prompt_id="p9", messages=[{"role": "user", "content": "2+2?"}], answer="4",
                          metadata={"source": "unit"})
    return RewardInput(sample=sample, response=response, messages=[{"role": "assistant", "content": response}])


def _model(srv: _Server, path: str, **kwargs: object) -> RemoteRewardModel:
    kwargs = {"timeout_s": 5.0, "max_retries": 3, "backoff_s": 0.01, **kwargs}
    return RemoteRewardModel(url=_url(srv, path), **kwargs)  # type: ignore[arg-type]


def test_scores_and_sends_the_trajectory(server: _Server) -> None:
    async def main() -> None:
        model = _model(server, "/score")
        assert await model(_inp("4")) == 1.0
        assert await model(_inp("5")) == 0.0
        await model.aclose()

    asyncio.run(main())
    path, body = server.requests[0]
    assert path == "/score"
    assert body == {"prompt_id": "p9", "messages": [{"role": "assistant", "content": "4"}], "response": "4",
                    "answer": "4", "metadata": {"source": "unit"}}


def test_retries_server_errors(server: _Server) -> None:
    assert asyncio.run(_model(server, "/flaky")(_inp("4"))) == 1.0
    assert server.count("/flaky") == 3


def test_gives_up_after_retries_on_timeouts(server: _Server) -> None:
    model = _model(server, "/slow", timeout_s=0.2, max_retries=2)
    with pytest.raises(RemoteRewardError, match="gave up after 3 attempts: ReadTimeout"):
        asyncio.run(model(_inp("4")))
    assert server.count("/slow") == 3


@pytest.mark.parametrize(("path", "message"), [
    ("/bad-request", "HTTP 400: missing field"),
    ("/not-json", "response is not JSON"),
    ("/no-field", "lacks a 'reward' field"),
])
def test_client_errors_are_not_retried(server: _Server, path: str, message: str) -> None:
    with pytest.raises(RemoteRewardError, match=message):
        asyncio.run(_model(server, path)(_inp("4")))
    assert server.count(path) == 1


def test_unreachable_server_becomes_a_failed_reward() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wrapper = SafeReward(RemoteRewardModel(url=f"http://127.0.0.1:{port}/score", max_retries=1, backoff_s=0.01))
    outcome = asyncio.run(wrapper(_inp("4")))
    assert not outcome.ok and outcome.reward is None
    assert "gave up after 2 attempts: ConnectError" in (outcome.error or "")
    assert wrapper.stats.failures == {"exception:RemoteRewardError": 1}


def test_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="must be http"):
        RemoteRewardModel(url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="timeout_s"):
        RemoteRewardModel(url="http://127.0.0.1:1", timeout_s=0)
