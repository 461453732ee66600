"""Shared pieces of the engine / agent-loop tests: the tiny checkpoint, an in-process CPU engine
on a free port, a scripted engine (no model) and a scripted test-only environment."""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megatron_sao.cpu_engine import CPUEngineConfig, ServerThread
from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint
from megatron_sao.rollout.client import FinishReason, GenerateOutput, SamplingParams, VersionSpan
from megatron_sao.rollout.engine_supervisor import free_port
from megatron_sao.rollout.environment import Environment, PromptSample, StepResult


@functools.cache
def tiny_checkpoint() -> Path:
    """One tiny Qwen3-MoE checkpoint per test process (built once, ~3 s; removed at exit)."""
    root = Path(tempfile.mkdtemp(prefix="sao_tiny_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return build_tiny_hf_checkpoint(root / "tiny", seed=0)


@functools.cache
def tiny_checkpoint_other_seed() -> Path:
    """A second tiny checkpoint with different random weights (for weight updates)."""
    root = Path(tempfile.mkdtemp(prefix="sao_tiny_b_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return build_tiny_hf_checkpoint(root / "tiny", seed=1)


@functools.cache
def stoppy_checkpoint() -> Path:
    """The tiny checkpoint with `<|im_end|>` sampled ~10% of the time: a random tiny model almost
    never closes its turn, so multi-turn tests would only see truncation. Embedding dimension 0 is
    set to 1 for every token, which makes the final normalised hidden state's dimension 0 a near
    constant (~7.6); `<|im_end|>`'s lm_head weight on that dimension then adds ~3.4 to its logit."""
    from safetensors.torch import load_file, save_file

    root = Path(tempfile.mkdtemp(prefix="sao_tiny_stop_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    path = shutil.copytree(tiny_checkpoint(), root / "tiny")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.embed_tokens.weight"][:, 0] = 1.0
    tensors["lm_head.weight"][IM_END, 0] = 0.45
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


IM_END = 258  # <|im_end|> in the tiny tokenizer (megatron_sao.models.tiny_hf.SPECIAL_TOKENS)

# The tiny chat template plus tools, Qwen-style: declared tools open the prompt as a system block
# (one JSON schema per line), and - so that a test notices observation glue computed without the
# tools - tool messages are wrapped in <tool_response> only when tools are declared.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tools_tokenizer():
    """The tiny tokenizer with `TOOLS_CHAT_TEMPLATE` (a fresh copy; the checkpoint is untouched)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint())
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    return tokenizer


@contextlib.contextmanager
def cpu_engine(model_path: Path | None = None, **overrides) -> Iterator[ServerThread]:
    """A CPU engine serving on 127.0.0.1 (free port) in this process; always stopped."""
    config = CPUEngineConfig(
        model_path=str(model_path or tiny_checkpoint()),
        host="127.0.0.1",
        port=free_port(),
        weight_version="0",
        threads=1,
        **overrides,
    )
    server = ServerThread(config).start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Answer:
    tokens: list[int]
    finish: str  # "stop" (tokens end with IM_END) or "abort" (an engine-side abort, partial)
    bump_at: int | None  # a weight update lands before this output index


@dataclass
class ScriptedEngine:
    """Answers generate calls from a script, honouring max_new_tokens like an engine does."""

    answers: list[Answer]
    version: int = 0
    base_url: str = "scripted://engine"
    calls: list[tuple[list[int], int, list[int], list[float], list[int], str]] = field(default_factory=list)

    async def generate(self, input_ids, sampling_params: SamplingParams, rid=None, **_) -> GenerateOutput:
        answer = self.answers.pop(0)
        limit = sampling_params.max_new_tokens
        tokens, finish = answer.tokens, answer.finish
        if len(tokens) > limit:
            tokens, finish = tokens[:limit], "length"
        logprobs = [-0.01 * (len(self.calls) + 1) - 0.001 * i for i in range(len(tokens))]
        versions = []
        for i in range(len(tokens)):
            if i == answer.bump_at:
                self.version += 1
            versions.append(self.version)
        spans: list[VersionSpan] = []
        for i, v in enumerate(versions):
            if spans and spans[-1].version == str(v):
                spans[-1].end = i + 1
            else:
                spans.append(VersionSpan(str(v), i, i + 1))
        self.calls.append((list(input_ids), limit, tokens, logprobs, versions, finish))
        return GenerateOutput(
            rid=rid or "",
            text="",
            output_ids=tokens,
            output_logprobs=logprobs,
            finish_reason=FinishReason(finish, matched=IM_END if finish == "stop" else None),
            prompt_tokens=len(input_ids),
            completion_tokens=len(tokens),
            weight_version=str(self.version),
            weight_version_spans=spans,
            meta_info={},
        )

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        return True

    async def abort_request(self, rid=None, abort_all=False) -> None:
        return None

    async def close(self) -> None:
        return None


class ScriptedEnv(Environment):
    """A test-only environment: `observations[i]` answers turn i; done after `done_after` turns
    with `terminal_reward`; `turn_rewards[i]` is the per-turn reward of turn i (not done).
    `raise_at` makes step `raise_at` raise; `fail_info_at` reports a caught failure instead."""

    def __init__(
        self,
        done_after: int = 2,
        terminal_reward: float = 1.0,
        turn_rewards: list[float] | None = None,
        observations: list[str] | None = None,
        raise_at: int | None = None,
        fail_info_at: int | None = None,
        role: str = "tool",
    ) -> None:
        self.done_after = done_after
        self.terminal_reward = terminal_reward
        self.turn_rewards = turn_rewards or []
        self.observations = observations or []
        self.raise_at = raise_at
        self.fail_info_at = fail_info_at
        self.role = role
        self.actions: list[str] = []
        self.closed = False

    async def reset(self, sample: PromptSample) -> list[dict[str, str]]:
        return list(sample.messages)

    async def step(self, action_text: str) -> StepResult:
        turn = len(self.actions)
        self.actions.append(action_text)
        if turn == self.raise_at:
            raise RuntimeError(f"scripted failure at turn {turn}")
        if turn == self.fail_info_at:
            return StepResult(observation="", info={"reward_error": "scripted reward failure"})
        if turn + 1 >= self.done_after:
            return StepResult(observation="", reward=self.terminal_reward, done=True)
        reward = self.turn_rewards[turn] if turn < len(self.turn_rewards) else 0.0
        text = self.observations[turn] if turn < len(self.observations) else f"observation {turn}"
        return StepResult(observation=text, reward=reward, role=self.role)

    async def close(self) -> None:
        self.closed = True


def sample(prompt_id: str = "p0", text: str = "Compute 2+2.") -> PromptSample:
    return PromptSample(prompt_id=prompt_id, messages=[{"role": "user", "content": text}])
