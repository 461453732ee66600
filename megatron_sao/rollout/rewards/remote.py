"""A reward model served over HTTP: POST the trajectory, read back `{"reward": <number>}`.

Wire format (JSON): request `{"prompt_id", "messages", "response", "answer", "metadata"}`;
response `{"reward": float}`. Connection errors, timeouts, HTTP 429 and 5xx are retried with
exponential backoff; other 4xx and malformed bodies are not (retrying cannot fix them). The
last error is raised, for `SafeReward` to record as a failed reward.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass, field

import httpx

from megatron_sao.rollout.rewards.base import RewardInput

logger = logging.getLogger(__name__)

_RETRYABLE_STATUS = {429, 500, 502, 503, 504}


class RemoteRewardError(RuntimeError):
    """The reward server could not give a reward for this input."""


@dataclass(kw_only=True)
class RemoteRewardModel:
    """Async reward function backed by an HTTP endpoint (one client per event loop)."""

    url: str
    timeout_s: float = 30.0
    """Per attempt: connect + send + wait + read."""
    max_retries: int = 3
    backoff_s: float = 0.5
    """Sleep before retry k (0-based) is backoff_s * 2**k, capped at max_backoff_s."""
    max_backoff_s: float = 8.0
    headers: dict[str, str] = field(default_factory=dict)
    trust_env: bool = False
    """Whether httpx honours HTTP(S)_PROXY etc.; off so a stray proxy setting cannot reroute."""
    _clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False)
    """One client per event loop (a client is bound to its loop); dropped with the loop."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"RemoteRewardModel.url must be http(s)://..., got {self.url!r}")
        if self.timeout_s <= 0 or self.max_retries < 0 or self.backoff_s < 0:
            raise ValueError("RemoteRewardModel: timeout_s must be > 0, max_retries and backoff_s >= 0")
        self.__name__ = f"remote({self.url})"

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers, trust_env=self.trust_env)
            self._clients[loop] = client
        return client

    async def __call__(self, inp: RewardInput) -> float:
        payload = {
            "prompt_id": inp.sample.prompt_id, "messages": inp.messages, "response": inp.response,
            "answer": inp.sample.answer, "metadata": inp.sample.metadata,
        }
        last_error = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            try:
                response = await self._client().post(self.url, json=payload)
            except httpx.TransportError as e:  # connect refused, timeouts, resets
                last_error = f"{type(e).__name__}: {e}"
                logger.debug("reward server %s attempt %d: %s", self.url, attempt + 1, last_error)
                continue
            if response.status_code in _RETRYABLE_STATUS:
                last_error = f"HTTP {response.status_code}"
                continue
            if response.status_code != 200:
                raise RemoteRewardError(f"{self.url}: HTTP {response.status_code}: {response.text[:200]}")
            return _parse_reward(self.url, response)
        raise RemoteRewardError(f"{self.url}: gave up after {self.max_retries + 1} attempts: {last_error}")

    async def aclose(self) -> None:
        """Close the HTTP client of the running loop (clients of finished loops are dropped)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()


def _parse_reward(url: str, response: httpx.Response) -> float:
    try:
        body = response.json()
    except ValueError as e:
        raise RemoteRewardError(f"{url}: response is not JSON: {response.text[:200]!r}") from e
    if not isinstance(body, dict) or "reward" not in body:
        raise RemoteRewardError(f"{url}: response lacks a 'reward' field: {str(body)[:200]}")
    reward = body["reward"]
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise RemoteRewardError(f"{url}: 'reward' must be a number, got {reward!r:.80}")
    return float(reward)
