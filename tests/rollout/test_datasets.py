"""Prompt datasets: the schema, every skip reason with its file and row, and malformed-data fuzz."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sao.rollout.datasets import SKIP_REASONS, DatasetConfig, LoadReport, iter_prompts, load_prompts


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_valid_rows_become_samples(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [
        json.dumps({"id": "a", "prompt": "What is 2+2?", "answer": 4, "metadata": {"level": 1}, "source": "x"}),
        "",  # blank lines are not rows, but keep line numbers honest
        json.dumps({"messages": [{"role": "system", "content": "Be terse."},
                                 {"role": "user", "content": "Name a prime."}], "answer": "2"}),
        json.dumps({"id": 7, "prompt": "Half of one?", "answer": 0.5}),
    ])
    data = load_prompts(path, DatasetConfig(system_prompt="You are helpful.", extra_metadata_keys=("source",)))
    assert [s.prompt_id for s in data] == ["a", "d.jsonl:3", "7"]
    first, second, third = data.samples
    assert first.messages == [{"role": "system", "content": "You are helpful."},
                              {"role": "user", "content": "What is 2+2?"}]
    assert first.answer == "4" and first.metadata == {"level": 1, "source": "x"}
    assert second.messages[0] == {"role": "system", "content": "Be terse."}  # its own system prompt kept
    assert third.answer == "0.5" and third.metadata == {}
    assert data.report.num_rows == 3 and data.report.num_skipped == 0


BAD_ROWS: list[tuple[str, str, str]] = [
    ("{not json", "bad_json", "JSONDecodeError"),
    ("[1, 2, 3]", "not_an_object", "JSON list"),
    ('{"answer": "1"}', "missing_field", "neither 'prompt' nor 'messages'"),
    ('{"prompt": 12}', "wrong_type", "'prompt' must be a string"),
    ('{"prompt": "q", "answer": [1]}', "wrong_type", "'answer' must be a string or number"),
    ('{"prompt": "q", "answer": true}', "wrong_type", "'answer' must be a string or number"),
    ('{"prompt": "q", "id": 1.5}', "wrong_type", "'id' must be"),
    ('{"prompt": "q", "metadata": "x"}', "wrong_type", "'metadata' must be an object"),
    ('{"messages": [{"role": "wizard", "content": "q"}]}', "wrong_type", "messages[0].role"),
    ('{"messages": [{"role": "user"}]}', "missing_field", "messages[0] needs 'role' and 'content'"),
    ('{"messages": "hello"}', "wrong_type", "non-empty list"),
    ('{"prompt": "   \\n "}', "empty_prompt", "no non-blank user content"),
    ('{"messages": [{"role": "system", "content": "only a system prompt"}]}', "empty_prompt", "no non-blank"),
    ('{"prompt": "' + "x" * 101 + '"}', "prompt_too_long", "101 characters > 100"),
    ('{"prompt": "q", "id": "dup"}', "duplicate_id", "'dup' already used"),
]


@pytest.mark.parametrize(("line", "reason", "detail"), BAD_ROWS,
                         ids=[f"{reason}-{i}" for i, (_, reason, _) in enumerate(BAD_ROWS)])
def test_each_bad_row_is_skipped_with_reason_file_and_row(tmp_path: Path, line: str, reason: str, detail: str) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "ok 1", "id": "dup"}', line, '{"prompt": "ok 2"}'])
    data = load_prompts(path, DatasetConfig(max_prompt_chars=100))
    assert [s.messages[-1]["content"] for s in data] == ["ok 1", "ok 2"]
    assert data.report.counts == {reason: 1}
    (skipped,) = data.report.skipped
    assert (skipped.path, skipped.row, skipped.reason) == (str(path), 2, reason)
    assert detail in skipped.detail


def test_invalid_utf8_and_gzip(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b'{"prompt": "fine"}\n{"prompt": "\xff\xfe"}\n')
    data = load_prompts(path)
    assert len(data) == 1 and data.report.counts == {"bad_json": 1}
    assert "not UTF-8" in data.report.skipped[0].detail


def test_token_limit_through_a_callback(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": p}) for p in
                                               ["one two three", "one two three four five", "boom"]])

    def count_words(text: str) -> int:
        if "boom" in text:
            raise RuntimeError("tokenizer exploded")
        return len(text.split())

    data = load_prompts(path, DatasetConfig(max_prompt_tokens=4, count_tokens=count_words))
    assert len(data) == 1
    assert data.report.counts == {"prompt_too_long": 1, "token_count_failed": 1}
    with pytest.raises(ValueError, match="go together"):
        DatasetConfig(max_prompt_tokens=4)


def test_require_answer(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": "1"}', '{"prompt": "b"}'])
    data = load_prompts(path, DatasetConfig(require_answer=True))
    assert len(data) == 1 and data.report.counts == {"missing_field": 1}


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match="unknown format"):
        load_prompts(tmp_path / "d.csv")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match=r"broken\.parquet is not a readable Parquet file"):
        load_prompts(tmp_path / "broken.parquet")
    pq.write_table(pa.table({"question": ["q"]}), tmp_path / "cols.parquet")
    with pytest.raises(ValueError, match="no 'prompt' or 'messages' column"):
        load_prompts(tmp_path / "cols.parquet")
    _write_jsonl(tmp_path / "allbad.jsonl", ["{", "[]"])
    with pytest.raises(ValueError, match=r"no valid prompt rows.*bad_json=1, not_an_object=1"):
        load_prompts(tmp_path / "allbad.jsonl")


# --- acceptance: 1% bad rows in 10,000 ---------------------------------------------------------

def _fuzz_rows(num_rows: int, bad_fraction: float, seed: int) -> tuple[list[str], dict[int, str]]:
    """JSONL lines with bad rows at random positions; returns lines and {line number: reason}."""
    rng = random.Random(seed)
    bad_positions = set(rng.sample(range(num_rows), int(num_rows * bad_fraction)))
    lines, expected = [], {}
    for i in range(num_rows):
        if i in bad_positions:
            line, reason, _ = BAD_ROWS[rng.randrange(len(BAD_ROWS) - 1)]  # the duplicate case needs a pair
            if rng.random() < 0.2:
                line, reason = json.dumps({"id": "good-0", "prompt": "dup"}), "duplicate_id"
            expected[i + 1] = reason
        else:
            line = json.dumps({"id": f"good-{i}", "prompt": f"question {i}", "answer": i})
        lines.append(line)
    assert 0 not in bad_positions  # good-0 must come first for the duplicate rows
    return lines, expected


def test_fuzz_1pct_bad_rows_in_10000_jsonl(tmp_path: Path) -> None:
    lines, expected = _fuzz_rows(10_000, 0.01, seed=1234)
    path = _write_jsonl(tmp_path / "fuzz.jsonl", lines)
    data = load_prompts(path, DatasetConfig(max_prompt_chars=100))
    assert len(expected) == 100
    assert len(data) == 9_900 and data.report.num_rows == 10_000
    good = [i for i in range(10_000) if i + 1 not in expected]
    assert [s.prompt_id for s in data] == [f"good-{i}" for i in good]  # order kept
    assert {(s.row, s.reason) for s in data.report.skipped} == set(expected.items())
    assert all(s.path == str(path) for s in data.report.skipped)
    counts: dict[str, int] = {}
    for reason in expected.values():
        counts[reason] = counts.get(reason, 0) + 1
    assert data.report.counts == counts


def test_fuzz_1pct_bad_rows_in_10000_parquet(tmp_path: Path) -> None:
    rng = random.Random(99)
    bad = dict(zip(sorted(rng.sample(range(1, 10_000), 100)),
                   rng.choices(["missing_field", "empty_prompt", "prompt_too_long", "duplicate_id",
                                "wrong_type"], k=100), strict=True))
    ids, prompts, messages = [], [], []
    for i in range(10_000):
        reason = bad.get(i)
        ids.append("good-0" if reason == "duplicate_id" else f"good-{i}")
        prompts.append({"missing_field": None, "empty_prompt": " ", "prompt_too_long": "y" * 500}.get(
            reason or "", f"question {i}"))
        messages.append([{"role": "robot", "content": "hi"}] if reason == "wrong_type" else None)
    pq.write_table(pa.table({"id": ids, "prompt": prompts, "messages": messages}), tmp_path / "fuzz.parquet",
                   row_group_size=3000)
    data = load_prompts(tmp_path / "fuzz.parquet", DatasetConfig(max_prompt_chars=100))
    assert len(data) == 9_900
    assert [s.prompt_id for s in data] == [f"good-{i}" for i in range(10_000) if i not in bad]
    assert {(s.row, s.reason) for s in data.report.skipped} == {(i + 1, r) for i, r in bad.items()}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.binary(max_size=60), st.text(max_size=60).map(str.encode),
                          st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                                       lambda kids: st.lists(kids, max_size=3)
                                       | st.dictionaries(st.sampled_from(["prompt", "messages", "answer", "id",
                                                                          "metadata", "role", "content"]),
                                                         kids, max_size=4),
                                       max_leaves=8).map(lambda v: json.dumps(v).encode())),
                min_size=1, max_size=30))
def test_arbitrary_lines_never_crash(tmp_path: Path, lines: list[bytes]) -> None:
    path = tmp_path / "h.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ").replace(b"\r", b" ") for line in lines) + b"\n")
    report = LoadReport()
    samples = list(iter_prompts([path], DatasetConfig(max_prompt_chars=1000), report))
    assert report.num_loaded == len(samples)
    assert report.num_rows == report.num_loaded + report.num_skipped
    assert set(report.counts) <= set(SKIP_REASONS)
