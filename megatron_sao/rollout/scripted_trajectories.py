"""Recorded trajectories from a scripted policy: training data whose reward a critic can learn.

Recorded-trajectory training, its tests and the CPU demo need trajectories that (a) are valid
records of this project's format, (b) carry *real* rollout log-probs, so that a trainer loading
the same checkpoint sees DIS ratios of ~1 at step 0, and (c) have a reward that is predictable
from what the critic sees, so that the critic's explained variance can rise well above 0.

The task: a calculator exercise. The user prompt carries its difficulty in plain sight
(`easy: 7+12` or `hard: 734*281-96`). The scripted policy makes 0 to `len(turn_weights) - 1`
calculator calls (`<tool_call>EXPR</tool_call>`, each followed by a `tool` observation with the
result), optionally thinking first (`<think> ... </think>`), then answers (`19`). It
succeeds with probability `easy_success` on easy prompts and `hard_success` on hard ones; a
failure either answers a wrong number (COMPLETED) or keeps calling the calculator until the turn
limit (TRUNCATED, reason `max_turns`). Terminal reward 1 for a correct answer, else 0; optional
per-turn reward on calculator calls. With the default 50/50 mix and 0.95 / 0.05 success, the
best value function that only reads the difficulty tag explains 1 - 0.0475 / 0.25 = 81% of the
return variance.

Lengths are long-tailed on purpose (the trainer's length bucketing and token-balanced
micro-batches must see it): thinking lengths are log-normal, and a `long_tail_fraction` of the
trajectories think `long_tail_factor` times longer. Thinking is counted in tokens of the
checkpoint's tokenizer, so the shape holds for any tokenizer. Everything is a pure function of
`seed` (trajectory ids included).

Action tokens are not sampled from the model: they are the script's. Their log-probs are what the
checkpoint's HF model assigns to them, teacher-forced in float32 (`teacher_forced_logprobs`),
i.e. exactly what an engine serving that checkpoint would have reported had it sampled them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_sao.rollout.chat_format import ChatFormat
from megatron_sao.rollout.trajectory import FinishType, RewardKind, Trajectory, TrajectoryStatus

_THINK_WORDS = ("let", "me", "check", "the", "sum", "first", "then", "carry", "digits", "so", "it", "is",
                "maybe", "wait", "again", "product", "minus", "step", "ok", "right")


@dataclass(kw_only=True, slots=True)
class ScriptedTaskConfig:
    """The scripted task's knobs (defaults: the demo's data)."""

    easy_fraction: float = 0.5
    """Share of prompts tagged easy."""
    easy_success: float = 0.95
    hard_success: float = 0.05
    turn_weights: tuple[float, ...] = (0.4, 0.3, 0.2, 0.1)
    """Relative odds of 1, 2, ... assistant turns (the last one answers, the others call the
    calculator); `len(turn_weights)` is the turn limit, which truncated failures use up."""
    truncated_failure_fraction: float = 0.3
    """Share of failures that hit the turn limit (TRUNCATED) instead of answering wrong."""
    think_fraction: float = 0.5
    """Share of trajectories whose actions start with a `<think>` block."""
    think_median_tokens: float = 8.0
    """Median thinking tokens per action (log-normal, sigma `think_sigma`)."""
    think_sigma: float = 0.6
    long_tail_fraction: float = 0.05
    long_tail_factor: float = 8.0
    """Long-tail trajectories think this many times longer (and always think)."""
    turn_reward: float = 0.0
    """Per-turn reward on every calculator call (0: terminal reward only)."""

    def __post_init__(self) -> None:
        for name in ("easy_fraction", "easy_success", "hard_success", "truncated_failure_fraction",
                     "think_fraction", "long_tail_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"ScriptedTaskConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if len(self.turn_weights) < 2 or min(self.turn_weights) < 0 or sum(self.turn_weights) <= 0:
            raise ValueError(f"ScriptedTaskConfig.turn_weights needs >= 2 non-negative odds with a positive sum "
                             f"(a turn limit of at least one call and an answer), got {self.turn_weights}")
        if self.think_median_tokens <= 0 or self.think_sigma < 0 or self.long_tail_factor < 1:
            raise ValueError("ScriptedTaskConfig: think_median_tokens > 0, think_sigma >= 0, long_tail_factor >= 1")


@dataclass(slots=True)
class ScriptedEpisode:
    """A scripted episode before scoring: prompt tokens, then alternating action / observation spans."""

    prompt_id: str
    trajectory_id: str
    prompt: list[int]
    actions: list[list[int]] = field(default_factory=list)
    observations: list[list[int]] = field(default_factory=list)  # observations[i] follows actions[i]
    status: TrajectoryStatus = TrajectoryStatus.COMPLETED
    reason: str = ""
    metadata: dict = field(default_factory=dict)

    def token_ids(self) -> list[int]:
        ids = list(self.prompt)
        for i, action in enumerate(self.actions):
            ids += action + (self.observations[i] if i < len(self.observations) else [])
        return ids


class _Script:
    """Writes episodes as token ids with the checkpoint's tokenizer and chat template."""

    def __init__(self, tokenizer, task: ScriptedTaskConfig) -> None:
        self.fmt = ChatFormat(tokenizer)
        self.stop = self.fmt.stop_token_ids[0]
        self.task = task
        self.word_ids = [self.fmt.encode(" " + w) for w in _THINK_WORDS]

    def problem(self, rng: random.Random) -> tuple[str, str, int]:
        if rng.random() < self.task.easy_fraction:
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            return "easy", f"{a}+{b}", a + b
        a, b, c = rng.randint(100, 999), rng.randint(100, 999), rng.randint(10, 99)
        return "hard", f"{a}*{b}-{c}", a * b - c

    def think(self, rng: random.Random, num_tokens: int) -> list[int]:
        if num_tokens <= 0:
            return []
        body: list[int] = []
        while len(body) < num_tokens:
            body += rng.choice(self.word_ids)
        return self.fmt.encode("<think>") + body[:num_tokens] + self.fmt.encode("</think>")

    def episode(self, rng: random.Random, prompt_id: str, trajectory_id: str,
                problem: tuple[str, str, int]) -> ScriptedEpisode:
        task = self.task
        difficulty, expression, value = problem
        prompt = self.fmt.encode_prompt([{"role": "user", "content": f"{difficulty}: {expression}"}])
        success = rng.random() < (task.easy_success if difficulty == "easy" else task.hard_success)
        truncated = not success and rng.random() < task.truncated_failure_fraction
        max_turns = len(task.turn_weights)
        num_turns = max_turns if truncated else rng.choices(range(1, max_turns + 1), task.turn_weights)[0]
        long_tail = rng.random() < task.long_tail_fraction
        thinks = long_tail or rng.random() < task.think_fraction
        think_scale = task.long_tail_factor if long_tail else 1.0
        ep = ScriptedEpisode(prompt_id, trajectory_id, prompt, metadata={
            "task": "scripted_calculator", "difficulty": difficulty, "expression": expression,
            "success": success, "long_tail": long_tail,
        })
        for turn in range(num_turns):
            median = task.think_median_tokens * think_scale
            think_len = round(rng.lognormvariate(math.log(median), task.think_sigma)) if thinks else 0
            head = self.think(rng, think_len)
            if truncated or turn < num_turns - 1:
                ep.actions.append(head + self.fmt.encode(f"<tool_call>{expression}</tool_call>") + [self.stop])
                if turn < num_turns - 1:
                    ep.observations.append(self.fmt.encode_observation(str(value), "tool", ep.actions[-1]))
            else:
                answer = value if success else value + rng.choice([-1, 1]) * rng.randint(1, 9)
                ep.actions.append(head + self.fmt.encode(f"{answer}") + [self.stop])
        if truncated:
            ep.status, ep.reason = TrajectoryStatus.TRUNCATED, "max_turns"
        return ep


@torch.inference_mode()
def teacher_forced_logprobs(model: torch.nn.Module, sequences: list[list[int]],
                            max_batch_tokens: int = 16384) -> list[list[float]]:
    """`out[i][t] = log p(sequences[i][t] | sequences[i][:t])` under `model` (an HF causal LM),
    `out[i][0] = 0.0`. Sequences are sorted by length and right-padded in batches of at most
    `max_batch_tokens` padded tokens (causal attention: padding after a token cannot change it)."""
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[list[float]] = [[] for _ in sequences]
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * len(sequences[order[end]]) <= max_batch_tokens:
            end += 1
        batch = [sequences[i] for i in order[start:end]]
        longest = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None].to(device))[..., 0].cpu()
        for row, i in enumerate(order[start:end]):
            out[i] = [0.0, *logp[row, : len(batch[row]) - 1].tolist()]
        start = end
    return out


def _build(ep: ScriptedEpisode, logprobs: list[float], turn_reward: float) -> Trajectory:
    traj = Trajectory(prompt_id=ep.prompt_id, trajectory_id=ep.trajectory_id, metadata=ep.metadata)
    traj.set_prompt(ep.prompt)
    cursor = len(ep.prompt)
    for i, action in enumerate(ep.actions):
        traj.append_action(action, logprobs[cursor : cursor + len(action)], [0] * len(action), FinishType.STOP)
        cursor += len(action)
        is_call = i < len(ep.actions) - 1 or ep.status == TrajectoryStatus.TRUNCATED
        if turn_reward and is_call:
            traj.add_reward(turn_reward, RewardKind.TURN, turn=i)
        if i < len(ep.observations):
            traj.append_observation(ep.observations[i])
            cursor += len(ep.observations[i])
    traj.add_reward(1.0 if ep.metadata["success"] else 0.0, RewardKind.TERMINAL)
    traj.num_engine_calls = len(ep.actions)
    traj.finish(ep.status, ep.reason)
    traj.validate()
    return traj


def script_episodes(tokenizer, num_trajectories: int, seed: int, group_size: int = 1,
                    task: ScriptedTaskConfig | None = None) -> list[ScriptedEpisode]:
    """The scripted episodes (token ids, outcome) without log-probs; see `make_scripted_trajectories`."""
    if num_trajectories < 1 or group_size < 1 or num_trajectories % group_size:
        raise ValueError(f"num_trajectories ({num_trajectories}) must be a positive multiple of group_size "
                         f"({group_size})")
    task = task or ScriptedTaskConfig()
    script = _Script(tokenizer, task)
    rng = random.Random(seed)
    episodes = []
    for p in range(num_trajectories // group_size):
        problem = script.problem(rng)
        prompt_id = f"scripted-s{seed}-p{p:06d}"
        for g in range(group_size):
            episodes.append(script.episode(rng, prompt_id, f"{prompt_id}-g{g}", problem))
    return episodes


def make_scripted_trajectories(
    hf_dir: str | Path,
    num_trajectories: int,
    seed: int,
    *,
    group_size: int = 1,
    task: ScriptedTaskConfig | None = None,
    max_batch_tokens: int = 16384,
) -> list[Trajectory]:
    """`num_trajectories` valid, finished trajectories of the scripted calculator task, tokenised
    with `hf_dir`'s tokenizer, action log-probs from `hf_dir`'s model (float32, teacher-forced),
    policy version 0. `group_size` G: G contiguous trajectories per prompt (same prompt id and
    problem, independent outcomes) for GRPO; else every prompt id is distinct. Deterministic in
    `seed`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir}: no config.json (not a HuggingFace checkpoint directory)")
    task = task or ScriptedTaskConfig()
    episodes = script_episodes(AutoTokenizer.from_pretrained(hf_dir), num_trajectories, seed, group_size, task)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    logprobs = teacher_forced_logprobs(model, [ep.token_ids() for ep in episodes], max_batch_tokens)
    return [_build(ep, lp, task.turn_reward) for ep, lp in zip(episodes, logprobs, strict=True)]
