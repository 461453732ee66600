"""Stop strings, `stop_regex`, stop tokens, `ignore_eos` and `min_new_tokens` on the CPU engine (sglang
0.5.23 semantics, stops.py). A large `logit_bias` on the letters a, b, c makes the greedy output a
deterministic string of those letters, so stop points can be predicted from one unstopped run."""

from __future__ import annotations

import httpx
import pytest

from megatron_sao.cpu_engine.stops import regex_max_chars, stop_window
from tests.rollout.engine_helpers import cpu_engine

PROMPT = [30, 31, 32, 33]
A, B, C, X = 64, 65, 66, 87  # 'a', 'b', 'c', 'x' in the tiny tokenizer
LETTERS = {str(A): 50.0, str(B): 50.0, str(C): 50.0}


@pytest.fixture(scope="module")
def engine():
    with cpu_engine() as server:
        yield server


def _generate(engine, **sampling):
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0.0, "logit_bias": LETTERS, **sampling}}
    response = httpx.post(engine.url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def letters(engine) -> tuple[str, list[int]]:
    out = _generate(engine, max_new_tokens=24, ignore_eos=True)
    assert set(out["text"]) <= {"a", "b", "c"} and len(out["text"]) == 24
    return out["text"], out["output_ids"]


def _first_stop(text: str, stop: str) -> int:
    """Tokens generated when `stop` first appears (one letter per token)."""
    return next(e for e in range(1, len(text) + 1) if stop in text[:e])


def test_stop_string_ends_generation_and_is_trimmed(engine, letters):
    text, ids = letters
    stop = text[6:8]
    end = _first_stop(text, stop)
    out = _generate(engine, max_new_tokens=24, ignore_eos=True, stop=[stop, "zz"])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[:end]
    assert out["text"] == text[: end - len(stop)]
    kept = _generate(engine, max_new_tokens=24, ignore_eos=True, stop=stop, no_stop_trim=True)
    assert kept["text"] == text[:end] and kept["output_ids"] == ids[:end]


def test_stop_regex_ends_generation_text_kept_as_sglang_does(engine, letters):
    text, ids = letters
    pattern = f"{text[9]}[{text[10]}]{text[11]}"
    end = _first_stop(text, text[9:12])
    out = _generate(engine, max_new_tokens=24, ignore_eos=True, stop_regex=[pattern])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["output_ids"] == ids[:end] and out["text"] == text[:end]


def test_stop_token_and_eos_and_ignore_eos(engine):
    forced = {str(X): 80.0}
    stopped = _generate(engine, max_new_tokens=5, logit_bias=forced, stop_token_ids=[X])
    assert stopped["output_ids"] == [X] and stopped["text"] == ""
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": X}
    kept = _generate(engine, max_new_tokens=5, logit_bias=forced, stop_token_ids=[X], no_stop_trim=True)
    assert kept["text"] == "x"
    ignored = _generate(engine, max_new_tokens=5, logit_bias=forced, stop_token_ids=[X], ignore_eos=True)
    assert ignored["output_ids"] == [X] * 5 and ignored["meta_info"]["finish_reason"]["type"] == "length"
    eos = _generate(engine, max_new_tokens=5, logit_bias={"258": 80.0})
    assert eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": 258}


def test_a_stop_on_the_last_allowed_token_is_a_stop(engine):
    """sglang 0.5.23 checks stops before the length limit."""
    out = _generate(engine, max_new_tokens=1, logit_bias={str(X): 80.0}, stop_token_ids=[X])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": X}


def test_min_new_tokens_masks_stop_tokens_until_reached(engine):
    forced = {str(X): 80.0, "258": 79.0}  # x first, EOS second
    out = _generate(engine, max_new_tokens=10, logit_bias=forced, stop_token_ids=[X], min_new_tokens=3)
    # x and EOS are masked for three tokens, so the best remaining letters come first, then x stops
    assert len(out["output_ids"]) == 4 and out["output_ids"][-1] == X
    assert X not in out["output_ids"][:3] and 258 not in out["output_ids"][:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": X}


def test_min_new_tokens_does_not_delay_a_stop_string(engine, letters):
    text, _ = letters
    end = _first_stop(text, text[0])
    out = _generate(engine, max_new_tokens=24, ignore_eos=True, stop=text[0], min_new_tokens=5)
    assert len(out["output_ids"]) == end == 1


def test_stop_window_bounds():
    assert regex_max_chars("ab[cd]") == 3
    assert regex_max_chars("(foo|barbaz)!") == 7
    assert regex_max_chars("a{2,4}") == 4
    assert regex_max_chars("a+") >= 1 << 30
    assert stop_window([2, 5], []) == 6
    assert stop_window([], ["x{3}"]) == 4
