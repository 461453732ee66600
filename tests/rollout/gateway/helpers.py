"""Shared pieces of the gateway tests: a recording engine client, a gateway on a CPU or scripted
engine, and a test-only tool-call format for the random tiny model."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from megatron_sao.rollout.client import EngineClient, GenerateOutput
from megatron_sao.rollout.engine_pool import EnginePool
from megatron_sao.rollout.gateway import Gateway, GatewayConfig, ParsedCall, SessionLimits
from tests.rollout.engine_helpers import tools_tokenizer

BASH_TOOL = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                              "parameters": {"type": "object",
                                                             "properties": {"command": {"type": "string"}},
                                                             "required": ["command"]}}}


class RecordingClient(EngineClient):
    """A real engine client that keeps every `/generate` call's input and answer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], GenerateOutput]] = []

    async def generate(self, input_ids, sampling_params, rid=None, return_logprob=True, **extra) -> GenerateOutput:
        out = await super().generate(input_ids, sampling_params, rid=rid, return_logprob=return_logprob, **extra)
        self.calls.append((list(input_ids), out))
        return out


class WholeTurnIsACall:
    """Test-only tool-call format: every turn is a `bash` call whose command is the turn's text.
    The tiny random model never writes Qwen's `<tool_call>` markup by chance; this lets a real
    engine drive the tool-call path end to end (the shipped formats are tested on their markup)."""

    name = "whole_turn"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        return "", [ParsedCall("bash", {"command": text})]

    def render(self, content: str, calls: list[ParsedCall]) -> str:
        return content + "".join(str(c.arguments.get("command", "")) for c in calls)


@contextlib.asynccontextmanager
async def gateway_on(clients: list[Any], tool_format: Any = "qwen3", tokenizer: Any = None,
                     **limits: Any) -> AsyncIterator[Gateway]:
    pool = EnginePool(clients)
    config = GatewayConfig(tool_call_format=tool_format, limits=SessionLimits(**limits))
    gateway = Gateway(pool, tokenizer or tools_tokenizer(), config)
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop()
        await pool.close()


def action_spans(traj) -> list[list[int]]:
    return [traj.token_ids[t.action_start:t.action_end] for t in traj.turns]


ONE_CALL_SCAFFOLD = '''
import json, os
from openai import OpenAI

task = json.load(open(os.environ["SAO_TASK_FILE"]))
reply = OpenAI().chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=task["messages"], max_tokens=8)
open("answer.txt", "w").write(reply.choices[0].message.content or "")
'''
"""A scaffold on the `openai` client: one chat call through the gateway, its answer written out."""


def one_call_scaffold_overrides(tmp_path) -> list[str]:
    """Config overrides for `rollout.environment=openai_scaffold` running `ONE_CALL_SCAFFOLD`, whose
    verifier gives 1.0 when the scaffold wrote its answer (so a completed episode is rewarded)."""
    import json

    script = tmp_path / "one_call_scaffold.py"
    script.write_text(ONE_CALL_SCAFFOLD)
    kwargs = {"command": ["{python}", str(script)], "timeout_s": 120,
              "verifier_command": ["{python}", "-c", "import os; print(1.0 if os.path.isfile('answer.txt') else 0.0)"]}
    return ["rollout.environment=openai_scaffold", f"rollout.environment_kwargs={json.dumps(kwargs)}"]
