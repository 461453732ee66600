"""The synthetic calculator task: oracle reward 1.0 through a tool call, graded reward for random
text, deterministic dataset generation, and the in-process calculator's strictness."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from megatron_sao.models.tiny_hf import SPECIAL_TOKENS
from megatron_sao.rollout.datasets import load_prompts
from megatron_sao.rollout.environment import TRUNCATION_REASON_KEY, PromptSample, StepResult
from megatron_sao.rollout.envs import make_env_factory
from megatron_sao.rollout.envs.calc import (
    CALC_TIERS,
    CALL_CLOSE,
    CALL_OPEN,
    CalcConfig,
    CalcEnv,
    evaluate_expression,
    generate_calc_samples,
    oracle_action,
    write_calc_dataset,
    write_calc_split,
)


def _play(env: CalcEnv, sample: PromptSample, policy, max_turns: int = 10) -> tuple[list[StepResult], int]:
    """Drive one episode; `policy(sample, observations) -> action`. Returns results and turns."""
    observations: list[str] = []
    results: list[StepResult] = []

    async def run() -> None:
        assert await env.reset(sample) == sample.messages
        for _ in range(max_turns):
            result = await env.step(policy(sample, observations))
            results.append(result)
            if result.done:
                return
            observations.append(result.observation)

    asyncio.run(run())
    return results, len(results)


def test_oracle_gets_full_reward_through_a_tool_call() -> None:
    factory = make_env_factory("calc")
    for sample in generate_calc_samples(200, seed=0, max_digits=3):
        results, turns = _play(factory(sample), sample, oracle_action)
        assert results[0].observation == sample.answer  # the calculator's answer
        assert results[-1].done and not results[-1].truncated and results[-1].reward == 1.0, sample
        assert results[-1].info["num_tool_calls"] == 1 and turns == 2


def test_answering_without_the_tool_is_not_optimal() -> None:
    sample = generate_calc_samples(1, seed=3)[0]
    results, _ = _play(CalcEnv(), sample, lambda s, obs: s.answer)
    assert results[0].done and results[0].reward == pytest.approx(0.8)
    assert results[0].info["tool"] == 0.0 and results[0].info["answer"] == 1.0


ALPHABET = [chr(c) for c in range(32, 127)] + ["\n"] + list(SPECIAL_TOKENS)


def _random_policy(rng: random.Random):
    """What a randomly initialised char-level model emits: uniform tokens of the tiny tokenizer's
    printable bytes and specials (incl. <tool_call>), random lengths."""
    def act(sample: PromptSample, observations: list[str]) -> str:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 24)))

    return act


def test_random_policy_gets_a_graded_nonzero_signal() -> None:
    rng = random.Random(0)
    factory = make_env_factory("calc")
    rewards = []
    for sample in generate_calc_samples(500, seed=1):
        results, _ = _play(factory(sample), sample, _random_policy(rng))
        assert results[-1].done  # the environment always ends and scores the episode itself
        rewards.append(results[-1].reward)
    mean = sum(rewards) / len(rewards)
    assert 0.01 < mean < 0.3, mean
    assert sum(r > 0 for r in rewards) >= 400  # almost every episode: any non-empty answer earns some
    assert len({round(r, 3) for r in rewards}) >= 20  # graded, not binary
    assert max(rewards) < 1.0


def test_partial_credit_orders_sensible_behaviours() -> None:
    sample = PromptSample(prompt_id="c", messages=[{"role": "user", "content": "12*34"}], answer="408",
                          metadata={"expression": "12*34"})

    def reward(actions: list[str]) -> float:
        results, _ = _play(CalcEnv(), sample, lambda s, obs: actions[len(obs)])
        return results[-1].reward

    rambling = reward(["zzzzzzzzzzzz"])
    short = reward(["zz"])
    digits = reward(["99"])
    anagram = reward(["480"])
    tool_wrong_copy = reward([f"{CALL_OPEN}12*3{CALL_CLOSE}", "408"])
    oracle = reward([f"{CALL_OPEN}12*34{CALL_CLOSE}", "408"])
    assert reward([""]) == 0.0
    assert 0.0 < rambling < short < digits < anagram < tool_wrong_copy < oracle == 1.0
    assert (rambling, short, digits, anagram, tool_wrong_copy) == pytest.approx((0.025, 0.075, 0.175, 0.5, 0.97778),
                                                                              abs=1e-4)


def test_turn_limit_ends_and_scores_the_episode() -> None:
    sample = generate_calc_samples(1, seed=5)[0]
    expression = sample.metadata["expression"]
    results, turns = _play(CalcEnv(CalcConfig(max_turns=2)), sample,
                           lambda s, obs: f"{CALL_OPEN}{expression}{CALL_CLOSE}")
    assert turns == 2 and results[-1].done and results[-1].truncated
    assert results[-1].info[TRUNCATION_REASON_KEY] == "max_turns"
    assert results[-1].reward == pytest.approx(0.2)  # tool credit only
    assert not any(r.truncated for r in results[:-1])
    assert results[0].observation == sample.answer


def test_dataset_generation_is_deterministic(tmp_path: Path) -> None:
    a = write_calc_dataset(tmp_path / "a.jsonl", 300, seed=7)
    b = write_calc_dataset(tmp_path / "b.jsonl", 300, seed=7)
    c = write_calc_dataset(tmp_path / "c.jsonl", 300, seed=8)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    loaded = load_prompts(a)
    assert loaded.report.num_skipped == 0
    assert [(s.prompt_id, s.messages, s.answer, s.metadata) for s in loaded] == \
        [(s.prompt_id, s.messages, s.answer, s.metadata) for s in generate_calc_samples(300, seed=7)]
    for s in loaded:
        assert evaluate_expression(s.metadata["expression"]) == int(s.answer)
    with pytest.raises(ValueError, match="operators"):
        generate_calc_samples(3, seed=0, operators="/")


def test_heldout_problems_repeat_no_training_problem(tmp_path: Path) -> None:
    """The demo's split (`write_calc_split`): the held-out problems, written back as a prompt file
    (`datasets.write_prompts`), load as the same samples, and none is a training problem."""
    from megatron_sao.rollout.datasets import write_prompts

    train, heldout = write_calc_split(tmp_path / "train.jsonl", 400, 64, seed=3, tiers=CALC_TIERS)
    training = {s.metadata["expression"] for s in load_prompts(train)}
    assert len(training) > 300 and len(heldout) == 64
    assert not training & {s.metadata["expression"] for s in heldout}
    again = load_prompts(write_prompts(tmp_path / "heldout.jsonl", heldout))
    assert [(s.prompt_id, s.messages, s.answer, s.metadata) for s in again] == \
        [(s.prompt_id, s.messages, s.answer, s.metadata) for s in heldout]


@pytest.mark.parametrize(("text", "value"), [
    ("23*47", 1081), (" -(3+4)*2 ", -14), ("((1))", 1),
    ("2**3", None), ("1/2", None), ("__import__('os')", None), ("1 2", None), ("", None), ("9" * 60, None),
])
def test_calculator_is_strict(text: str, value: int | None) -> None:
    assert evaluate_expression(text) == value


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        CalcConfig(tool_weight=0.5)
    with pytest.raises(ValueError, match="has no answer"):
        asyncio.run(CalcEnv().reset(PromptSample(prompt_id="x", messages=[{"role": "user", "content": "1+1"}])))
