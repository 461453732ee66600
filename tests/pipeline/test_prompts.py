"""The prompt stream: every prompt once per epoch, seeded shuffles, groups, resumable position."""

from __future__ import annotations

import pytest

from megatron_sao.pipeline.prompts import PromptStream
from megatron_sao.rollout.environment import PromptSample


def _samples(n: int) -> list[PromptSample]:
    return [PromptSample(prompt_id=f"p{i}", messages=[{"role": "user", "content": f"q{i}"}]) for i in range(n)]


def _ids(stream, n):
    return [next(stream).prompt_id for _ in range(n)]


def test_epochs_visit_every_prompt_once_in_a_seeded_order():
    stream = PromptStream(_samples(5), shuffle=True, seed=3)
    first, second = _ids(stream, 5), _ids(stream, 5)
    assert sorted(first) == sorted(second) == [f"p{i}" for i in range(5)]
    assert first != second  # a new permutation each epoch
    assert _ids(PromptStream(_samples(5), shuffle=True, seed=3), 5) == first
    assert _ids(PromptStream(_samples(5), shuffle=False, seed=3), 5) == [f"p{i}" for i in range(5)]
    assert stream.epochs_done == pytest.approx(2.0)


def test_groups_repeat_each_prompt():
    stream = PromptStream(_samples(3), shuffle=False, seed=0, group_size=2)
    assert _ids(stream, 6) == ["p0", "p0", "p1", "p1", "p2", "p2"]


def test_resume_continues_the_stream_and_restarts_unfinished_prompts():
    stream = PromptStream(_samples(7), shuffle=True, seed=1)
    _ids(stream, 9)
    unfinished = [stream.samples[2]]
    state = stream.state_dict(unfinished=unfinished)
    expected = _ids(stream, 6)
    resumed = PromptStream(_samples(7), shuffle=True, seed=1)
    resumed.load_state_dict(state)
    assert _ids(resumed, 7) == ["p2", *expected]
    with pytest.raises(ValueError, match="has 6 prompts"):
        PromptStream(_samples(6), shuffle=True, seed=1).load_state_dict(state)


def test_finite_epochs_and_bad_input():
    stream = PromptStream(_samples(2), shuffle=False, seed=0, num_epochs=1)
    assert _ids(stream, 2) == ["p0", "p1"]
    with pytest.raises(StopIteration):
        next(stream)
    with pytest.raises(ValueError, match="empty"):
        PromptStream([], shuffle=False, seed=0)
