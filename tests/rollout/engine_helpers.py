"""Shared pieces of the engine / agent-loop tests: the tiny checkpoint, an in-process CPU engine
on a free port, and a scripted test-only environment."""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from megatron_sao.rollout.cpu_engine import CPUEngineConfig, ServerThread
from megatron_sao.rollout.environment import Environment, PromptSample, StepResult
from megatron_sao.rollout.launcher import free_port
from megatron_sao.utils.tiny_hf import build_tiny_hf_checkpoint


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


IM_END = 258  # <|im_end|> in the tiny tokenizer (megatron_sao.utils.tiny_hf.SPECIAL_TOKENS)


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

    def reset(self, sample: PromptSample) -> list[dict[str, str]]:
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
