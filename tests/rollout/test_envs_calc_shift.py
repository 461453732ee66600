"""`calc_shift`: the calc task under a preference that shifts with the prompt's stream position
(online mode), and the pipeline's stream positions that drive it (exact across a resume)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from megatron_sao.pipeline.prompts import PromptStream, positioned
from megatron_sao.rollout.environment import STREAM_POSITION_KEY
from megatron_sao.rollout.envs import make_env_factory
from megatron_sao.rollout.envs.calc import CALL_CLOSE, CALL_OPEN, generate_calc_samples, oracle_action


def _episode(factory, sample, actions):
    env = factory(sample)

    async def run():
        await env.reset(sample)
        result = None
        for action in actions:
            result = await env.step(action)
            if result.done:
                break
        return result

    return asyncio.run(run())


def _at(sample, position):
    return dataclasses.replace(sample, metadata={**sample.metadata, STREAM_POSITION_KEY: position})


def test_each_phase_rewards_its_own_preference():
    factory = make_env_factory("calc_shift", phases=["result", "echo", "result"], phase_length=10)
    sample = generate_calc_samples(1, seed=3)[0]
    expression, result = sample.metadata["expression"], sample.answer
    with_tool = [f"{CALL_OPEN}{expression}{CALL_CLOSE}", result]
    for position, phase in ((0, 0), (9, 0), (10, 1), (19, 1), (20, 2), (500, 2)):
        tool_episode = _episode(factory, _at(sample, position), with_tool)
        echo_episode = _episode(factory, _at(sample, position), [expression])
        assert tool_episode.info["phase"] == phase == echo_episode.info["phase"]
        if phase == 1:  # echo: the expression is the answer, the tool earns nothing
            assert echo_episode.reward == 1.0 and tool_episode.reward < 0.6
        else:  # result: calc's own reward
            assert tool_episode.reward == 1.0 and echo_episode.reward < 1.0


def test_missing_position_and_bad_settings_are_clear_errors():
    factory = make_env_factory("calc_shift")
    sample = generate_calc_samples(1, seed=3)[0]
    with pytest.raises(ValueError, match="stream_position"):
        _episode(factory, sample, ["1"])
    with pytest.raises(ValueError, match="phases"):
        make_env_factory("calc_shift", phases=["result", "cute"])
    with pytest.raises(ValueError, match="phase_length"):
        make_env_factory("calc_shift", phase_length=0)


def test_stream_positions_count_draws_and_survive_a_resume():
    samples = generate_calc_samples(5, seed=0)
    stream = PromptStream(samples, shuffle=True, seed=1)
    drawn = positioned(stream)
    first = [next(drawn) for _ in range(7)]  # crosses an epoch boundary
    assert [s.metadata[STREAM_POSITION_KEY] for s in first] == list(range(7))
    # Checkpoint with the last two unfinished: a resumed stream hands them out again with their
    # original positions, then continues the count.
    state = stream.state_dict(unfinished=first[-2:])
    resumed = PromptStream(samples, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    continued = positioned(resumed)
    after_resume = [next(continued) for _ in range(4)]
    assert [s.metadata[STREAM_POSITION_KEY] for s in after_resume] == [5, 6, 7, 8]
    reference = [next(drawn) for _ in range(2)]
    assert [s.prompt_id for s in after_resume[2:]] == [s.prompt_id for s in reference]


def _demonstration_reward(factory, sample, teacher, position):
    """The reward `teacher`'s episode earns at stream `position` (observations fed back as the
    demonstration recorder does)."""
    sample = _at(sample, position)
    env = factory(sample)

    async def run():
        await env.reset(sample)
        observations = []
        for _ in range(3):
            result = await env.step(teacher(sample, observations))
            if result.done:
                return result
            observations.append(result.observation)
        raise AssertionError("the demonstration did not end")

    return asyncio.run(run())


@pytest.mark.parametrize("echo_share", [0.5, 0.3])
def test_mixed_oracle_writes_both_styles_in_the_stated_proportion(echo_share):
    from megatron_sao.rollout.envs.calc_shift import demonstration_style, mixed_oracle

    samples = generate_calc_samples(1024, seed=1241)
    teacher = mixed_oracle(echo_share)
    firsts = [teacher(s, []) for s in samples]
    calls = [a.startswith(CALL_OPEN) for a in firsts]
    echo = [not c for c in calls]
    assert abs(sum(echo) / len(samples) - echo_share) < 0.05  # a hash of the prompt id, ~binomial
    for sample, first, is_echo in zip(samples, firsts, echo, strict=True):
        assert demonstration_style(sample, echo_share) == ("echo" if is_echo else "result")
        if is_echo:  # the answer at once: the expression
            assert first == sample.metadata["expression"]
        else:  # calc's oracle: call the tool on the expression, then answer with the observation
            assert first == f"{CALL_OPEN}{sample.metadata['expression']}{CALL_CLOSE}"
            assert teacher(sample, [sample.answer]) == sample.answer
    assert [teacher(s, []) for s in samples] == firsts  # the same prompt always gets the same style
    assert all(mixed_oracle(0.0)(s, []).startswith(CALL_OPEN) for s in samples[:50])
    assert not any(mixed_oracle(1.0)(s, []).startswith(CALL_OPEN) for s in samples[:50])
    with pytest.raises(ValueError, match="echo_share"):
        mixed_oracle(1.5)


def test_each_style_scores_one_under_its_own_preference_and_less_under_the_other():
    from megatron_sao.rollout.envs.calc_shift import echo_action

    factory = make_env_factory("calc_shift", phases=["result", "echo"], phase_length=1)
    for sample in generate_calc_samples(64, seed=5):
        result_style = [_demonstration_reward(factory, sample, oracle_action, p) for p in (0, 1)]
        echo_style = [_demonstration_reward(factory, sample, echo_action, p) for p in (0, 1)]
        assert [r.info["phase"] for r in result_style] == [0, 1]
        assert result_style[0].reward == 1.0 and result_style[1].reward < 0.7
        assert echo_style[1].reward == 1.0 and echo_style[0].reward < 0.7


def test_demonstration_share_is_a_recipe_setting_the_environment_ignores():
    from megatron_sao.rollout.envs.calc_shift import CalcShiftConfig

    config = CalcShiftConfig.from_kwargs(phases=["echo"], phase_length=4, demonstration_echo_share=0.25, max_turns=2)
    assert config.demonstration_echo_share == 0.25 and config.calc.max_turns == 2
    make_env_factory("calc_shift", demonstration_echo_share=0.25)  # accepted by the registry builder
    with pytest.raises(ValueError, match="demonstration_echo_share"):
        CalcShiftConfig.from_kwargs(demonstration_echo_share=-0.1)
