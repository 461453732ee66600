"""The tiny synthetic tool task the CPU demo trains on: integer arithmetic with a calculator.

Prompt: an expression such as `23*47`. The model cannot be expected to multiply, but it can
learn to *copy*: copy the expression into a calculator call `<tool_call>23*47</tool_call>`
(`<tool_call>` is one special token of the tiny tokenizer, the body is plain text, no JSON),
read the observation `1081`, and copy that as its final answer (a turn without a call). So the
optimum needs at least one tool call, and every skill on the way is learnable by a tiny model.

Reward, graded so that a randomly initialised char-level model already gets a non-zero,
varying signal (weights sum to 1; the scripted oracle gets exactly 1.0):

    0.2 * format   mean of: 1 / (1 + |len(answer) - len(reference)| / len(reference)) (any
                   non-empty answer earns some; it teaches ending the turn), and the share of
                   answer characters that are digits or '-'
    0.2 * tool     1 if some call evaluates to the answer, else best character-F1 of a call vs
                   the expression (0 without calls)
    0.6 * answer   1 if exact, else 0.5 * character-F1 of answer vs the reference

Answering correctly without the tool earns 0.8, so the optimum needs the call.

Difficulty tiers (`CALC_TIERS`, `generate_calc_samples(..., tiers=...)`): problems of several
shapes (operand count, digit count, operators), each tagged `metadata["tier"]`. A tiny policy
copies short expressions almost always right and long ones often wrong, so success depends on
the prompt and a critic has something to predict from it (the embedded default's demo trains on
the tiered mix; docs/pipeline.md has the measured success per tier). Without `tiers` the
problems are the original two-operand ones (`max_digits`, `operators`).

Turn limits: this environment ends (and scores) the episode itself after `max_turns` assistant
turns (`StepResult.truncated`, reason "max_turns": the loop records it TRUNCATED with this
environment's graded reward), so set the agent loop's `max_turns` at least as high. The
calculator runs in-process (a strict arithmetic evaluator, no sandbox: the demo makes thousands
of calls).
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_sao.rollout.datasets import write_prompts
from megatron_sao.rollout.environment import TRUNCATION_REASON_KEY, Environment, PromptSample, StepResult

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_ARITHMETIC = re.compile(r"[0-9+\-*() ]+")


@dataclass(kw_only=True, slots=True)
class CalcConfig:
    max_turns: int = 3
    """Assistant turns after which the episode ends and is scored (answer part 0 if none)."""
    max_expression_chars: int = 48
    format_weight: float = 0.2
    tool_weight: float = 0.2
    answer_weight: float = 0.6

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"CalcConfig.max_turns must be >= 1, got {self.max_turns}")
        if abs(self.format_weight + self.tool_weight + self.answer_weight - 1.0) > 1e-9:
            raise ValueError("CalcConfig: the reward weights must sum to 1")


def evaluate_expression(text: str, max_chars: int = 48) -> int | None:
    """Integer value of `+ - * ( )` arithmetic, or None for anything else (never raises)."""
    text = text.strip()
    if not text or len(text) > max_chars or not _ARITHMETIC.fullmatch(text):
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return _evaluate(tree.body)


def _evaluate(node: ast.expr) -> int | None:
    if isinstance(node, ast.Constant):
        return node.value if type(node.value) is int else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if left is None or right is None:
            return None
        return left + right if isinstance(node.op, ast.Add) else left - right if isinstance(node.op, ast.Sub) \
            else left * right
    return None


def char_f1(predicted: str, reference: str) -> float:
    """F1 of the character multisets: partial credit that random text already earns a little of."""
    common = sum((Counter(predicted) & Counter(reference)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def score(calls: list[str], answer: str | None, expression: str, target: str, config: CalcConfig) -> dict[str, float]:
    """Reward and its parts for an episode with these call bodies and final answer."""
    answer = (answer or "").strip()
    fmt = 0.0
    if answer:
        length = 1.0 / (1.0 + abs(len(answer) - len(target)) / max(1, len(target)))
        fmt = 0.5 * length + 0.5 * sum(ch.isdigit() or ch == "-" for ch in answer) / len(answer)
    target_value = evaluate_expression(target)
    tool = 0.0
    for body in calls:
        if target_value is not None and evaluate_expression(body, config.max_expression_chars) == target_value:
            tool = 1.0
            break
        tool = max(tool, char_f1(body.strip(), expression))
    correct = 1.0 if answer and answer == target else 0.5 * char_f1(answer, target) if answer else 0.0
    reward = config.format_weight * fmt + config.tool_weight * tool + config.answer_weight * correct
    return {"reward": round(reward, 9), "format": fmt, "tool": tool, "answer": correct}


class CalcEnv(Environment):
    """One episode of the calculator task."""

    def __init__(self, config: CalcConfig | None = None) -> None:
        self.config = config or CalcConfig()
        self.expression = ""
        self.target = ""
        self.calls: list[str] = []
        self.turns = 0

    async def reset(self, sample: PromptSample) -> list[dict[str, str]]:
        if sample.answer is None:
            raise ValueError(f"calc sample {sample.prompt_id!r} has no answer")
        self.expression = str(sample.metadata.get("expression", sample.messages[-1]["content"]))
        self.target = sample.answer
        return [dict(m) for m in sample.messages]

    async def step(self, action_text: str) -> StepResult:
        self.turns += 1
        if CALL_OPEN in action_text:
            body = action_text.split(CALL_OPEN, 1)[1].split(CALL_CLOSE, 1)[0]
            self.calls.append(body)
            value = evaluate_expression(body, self.config.max_expression_chars)
            observation = "error" if value is None else str(value)
            if self.turns >= self.config.max_turns:
                return self._end(None, truncated=True)
            return StepResult(observation=observation)
        return self._end(action_text, truncated=False)

    def _end(self, answer: str | None, truncated: bool) -> StepResult:
        parts = score(self.calls, answer, self.expression, self.target, self.config)
        info: dict[str, Any] = {**parts, "num_tool_calls": len(self.calls)}
        if truncated:
            info[TRUNCATION_REASON_KEY] = "max_turns"
        return StepResult(observation="", reward=parts["reward"], done=True, truncated=truncated, info=info)


def make_calc(**kwargs: Any) -> Any:
    """Registry builder: CalcConfig fields as keyword arguments."""
    config = CalcConfig(**kwargs)
    return lambda sample: CalcEnv(config)


@dataclass(frozen=True, slots=True)
class CalcTier:
    """One shape of problem: `operands` numbers of `min_digits` to `digits` digits (each count
    equally likely; 1 digit: 0-9) joined by operators drawn from `operators`."""

    name: str
    operands: int
    digits: int
    operators: str
    min_digits: int | None = None
    """Fewest digits of an operand (None: exactly `digits`)."""

    def __post_init__(self) -> None:
        low = self.digits if self.min_digits is None else self.min_digits
        if self.operands < 2 or not 1 <= low <= self.digits or not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"CalcTier {self.name!r}: operands >= 2, 1 <= min_digits <= digits, operators from '+-*'")

    def _number(self, rng: random.Random) -> str:
        digits = self.digits if self.min_digits is None else rng.randint(self.min_digits, self.digits)
        return str(rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits))

    def expression(self, rng: random.Random) -> str:
        numbers = [self._number(rng) for _ in range(self.operands)]
        ops = [rng.choice(self.operators) for _ in range(self.operands - 1)]
        return numbers[0] + "".join(op + n for op, n in zip(ops, numbers[1:], strict=True))


CALC_TIERS: tuple[CalcTier, ...] = (
    CalcTier("t0_2x1-2digit", operands=2, digits=2, min_digits=1, operators="+-"),  # 7+23: 3-5 characters to copy
    CalcTier("t1_2x2digit", operands=2, digits=2, operators="+-*"),                 # 23*47: 5
    CalcTier("t2_3x2digit", operands=3, digits=2, operators="+-*"),                 # 23*47+18: 8
    CalcTier("t3_3x3digit", operands=3, digits=3, operators="+-*"),                 # 123*456-789: 11
)
"""The embedded default's difficulty tiers, easiest first (drawn with equal probability)."""


def generate_calc_samples(num_samples: int, seed: int, *, max_digits: int = 2, operators: str = "+-*",
                          tiers: tuple[CalcTier, ...] | None = None) -> list[PromptSample]:
    """`num_samples` problems, a pure function of the arguments (same seed, same problems). With
    `tiers`, each problem's tier is drawn uniformly and recorded in `metadata["tier"]`."""
    if num_samples < 0 or max_digits < 1 or not operators or set(operators) - set("+-*"):
        raise ValueError("generate_calc_samples: num_samples >= 0, max_digits >= 1, operators from '+-*'")
    if tiers is not None and not tiers:
        raise ValueError("generate_calc_samples: tiers must name at least one CalcTier (or be None)")
    rng = random.Random(seed)
    samples = []
    for i in range(num_samples):
        metadata: dict[str, Any] = {}
        if tiers is None:
            a, b = (rng.randrange(10 ** rng.randint(1, max_digits)) for _ in range(2))
            expression = f"{a}{rng.choice(operators)}{b}"
        else:
            tier = tiers[rng.randrange(len(tiers))]
            expression = tier.expression(rng)
            metadata["tier"] = tier.name
        value = evaluate_expression(expression)
        assert value is not None, expression
        samples.append(PromptSample(prompt_id=f"calc-{seed}-{i}", messages=[{"role": "user", "content": expression}],
                                    answer=str(value), metadata={"expression": expression, **metadata}))
    return samples


def write_calc_dataset(path: str | Path, num_samples: int, seed: int, **kwargs: Any) -> Path:
    """Write the problems as JSONL in the prompt-dataset schema (`datasets.load_prompts` reads it)."""
    return write_prompts(path, generate_calc_samples(num_samples, seed, **kwargs))


def write_calc_split(path: str | Path, num_train: int, num_heldout: int, seed: int,
                     tiers: tuple[CalcTier, ...] | None = None,
                     exclude: Collection[str] = ()) -> tuple[Path, list[PromptSample]]:
    """Training problems written to `path` (`write_calc_dataset`), and `num_heldout` held-out problems
    (drawn from another seed) whose expressions no training problem repeats, nor `exclude` (e.g. the
    expressions of SFT demonstrations)."""
    training = generate_calc_samples(num_train, seed, tiers=tiers)
    train = write_prompts(path, training)
    seen = {s.metadata["expression"] for s in training} | set(exclude)
    candidates = generate_calc_samples(num_heldout * 4, seed + 1_000_003, tiers=tiers)
    return train, [s for s in candidates if s.metadata["expression"] not in seen][:num_heldout]


def oracle_action(sample: PromptSample, observations: list[str]) -> str:
    """The scripted optimal policy: call the calculator on the expression, then answer with
    what it returned. Reward 1.0 (tests; SFT warm-start data for the demo)."""
    if not observations:
        return f"{CALL_OPEN}{sample.metadata.get('expression', sample.messages[-1]['content'])}{CALL_CLOSE}"
    return observations[-1]
