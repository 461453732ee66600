"""`calc_shift`: the calc task under a preference that shifts with the prompt's stream position
(online mode), and the pipeline's stream positions that drive it (exact across a resume)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from megatron_sao.pipeline.engine_source import positioned
from megatron_sao.pipeline.prompts import PromptStream
from megatron_sao.rollout.environment import STREAM_POSITION_KEY
from megatron_sao.rollout.envs import make_env_factory
from megatron_sao.rollout.envs.calc import CALL_CLOSE, CALL_OPEN, generate_calc_samples


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
    again = [next(positioned(resumed)) for _ in range(1)]
    rest = positioned(resumed)
    following = [next(rest) for _ in range(3)]
    assert [s.metadata[STREAM_POSITION_KEY] for s in [*again, *following]] == [5, 6, 7, 8]
    reference = [next(drawn) for _ in range(2)]
    assert [s.prompt_id for s in following[1:]] == [s.prompt_id for s in reference]
