"""Prompt datasets: JSONL / Parquet rows -> validated `PromptSample`s, bad rows counted not fatal.

Row schema (field names configurable in `DatasetConfig`):

    id        str | int, optional       unique prompt id; default "<file name>:<row>"
    prompt    str                       one user message ...
    messages  [{"role", "content"}]     ... or a whole chat prompt (roles system/user/assistant/tool)
    answer    str | int | float, opt.   reference for the reward; numbers become strings
    metadata  object, optional          copied to PromptSample.metadata (with `extra_metadata_keys`)

Exactly one of prompt / messages is used (messages wins when both are present). A row that is
not valid JSON, not an object, lacks a field, has a field of the wrong type, an empty or
over-long prompt (characters, or tokens through a callback), or repeats an earlier id is
skipped; the rest keep their order. Every skip is counted by reason and recorded with its file
and 1-based row number (the line number for JSONL, blank lines included). Problems with a whole
file (missing, unreadable, unknown format, no prompt column) raise `ValueError`.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_sao.rollout.environment import PromptSample

logger = logging.getLogger(__name__)

SKIP_REASONS = ("bad_json", "not_an_object", "missing_field", "wrong_type", "empty_prompt",
                "prompt_too_long", "token_count_failed", "duplicate_id")
ROLES = ("system", "user", "assistant", "tool")
_LOGGED_SKIPS = 20  # per load, at WARNING; all are in the report


@dataclass(kw_only=True, slots=True)
class DatasetConfig:
    """How rows map to `PromptSample`s and which rows are rejected."""

    prompt_key: str = "prompt"
    messages_key: str = "messages"
    answer_key: str = "answer"
    id_key: str = "id"
    metadata_key: str = "metadata"
    extra_metadata_keys: tuple[str, ...] = ()
    """Other top-level fields copied into metadata when present (e.g. "level", "source")."""
    system_prompt: str | None = None
    """Prepended as a system message to rows whose prompt has none."""
    require_answer: bool = False
    """Skip rows without an answer (tasks whose reward needs a reference)."""
    max_prompt_chars: int | None = None
    """Limit on the summed length of all message contents, in characters."""
    max_prompt_tokens: int | None = None
    """Limit in tokens, counted by `count_tokens` on the message contents joined by newlines."""
    count_tokens: Callable[[str], int] | None = None
    max_recorded_skips: int = 10_000
    """Skipped rows kept in the report with their details (counts are always complete)."""

    def __post_init__(self) -> None:
        if (self.max_prompt_tokens is None) != (self.count_tokens is None):
            raise ValueError("DatasetConfig: max_prompt_tokens and count_tokens go together")


@dataclass(slots=True)
class SkippedRow:
    path: str
    row: int
    reason: str
    detail: str


@dataclass(slots=True)
class LoadReport:
    """What was read: rows seen, samples kept, and every skip by reason."""

    num_rows: int = 0
    num_loaded: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    skipped: list[SkippedRow] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        reasons = ", ".join(f"{reason}={n}" for reason, n in sorted(self.counts.items())) or "none"
        return f"{self.num_loaded}/{self.num_rows} rows loaded; skipped: {reasons}"


@dataclass(slots=True)
class PromptDataset:
    samples: list[PromptSample]
    report: LoadReport

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[PromptSample]:
        return iter(self.samples)

    def __getitem__(self, index: int) -> PromptSample:
        return self.samples[index]


class _Skip(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        assert reason in SKIP_REASONS, reason
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def load_prompts(paths: str | Path | Sequence[str | Path], config: DatasetConfig | None = None) -> PromptDataset:
    """Read every file in order; raises ValueError if no row at all is valid."""
    cfg = config or DatasetConfig()
    files = [paths] if isinstance(paths, str | Path) else list(paths)
    if not files:
        raise ValueError("load_prompts: no files given")
    report = LoadReport()
    samples = list(iter_prompts(files, cfg, report))
    if report.num_skipped:
        logger.warning("prompt data %s: %s", ", ".join(map(str, files)), report.summary())
    if not samples:
        raise ValueError(f"no valid prompt rows in {', '.join(map(str, files))}: {report.summary()}")
    return PromptDataset(samples=samples, report=report)


def write_prompts(path: str | Path, samples: Iterable[PromptSample]) -> Path:
    """`samples` as JSONL in the schema `load_prompts` reads (id, prompt, answer, metadata)."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for sample in samples:
            row = {"id": sample.prompt_id, "prompt": sample.messages[-1]["content"], "answer": sample.answer,
                   "metadata": sample.metadata}
            f.write(json.dumps(row, sort_keys=True) + "\n")
    return path


def iter_prompts(files: Iterable[str | Path], config: DatasetConfig, report: LoadReport) -> Iterator[PromptSample]:
    """Stream samples from the files in order, recording skips in `report` as it goes."""
    seen_ids: set[str] = set()
    for file in files:
        path = Path(file)
        for row_number, row in _read_rows(path, config):
            report.num_rows += 1
            try:
                if isinstance(row, _Skip):
                    raise row
                sample = _to_sample(row, path, row_number, config)
                if sample.prompt_id in seen_ids:
                    raise _Skip("duplicate_id", f"id {sample.prompt_id!r} already used by an earlier row")
            except _Skip as skip:
                _record(report, config, SkippedRow(str(path), row_number, skip.reason, skip.detail))
                continue
            seen_ids.add(sample.prompt_id)
            report.num_loaded += 1
            yield sample


def _record(report: LoadReport, config: DatasetConfig, skipped: SkippedRow) -> None:
    report.counts[skipped.reason] += 1
    if len(report.skipped) < config.max_recorded_skips:
        report.skipped.append(skipped)
    level = logging.WARNING if report.num_skipped <= _LOGGED_SKIPS else logging.DEBUG
    logger.log(level, "skipping %s row %d: %s (%s)", skipped.path, skipped.row, skipped.reason, skipped.detail)


def _read_rows(path: Path, config: DatasetConfig) -> Iterator[tuple[int, Any]]:
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        yield from _read_jsonl(path)
    elif name.endswith(".parquet"):
        yield from _read_parquet(path, config)
    else:
        raise ValueError(f"prompt file {path}: unknown format; use .jsonl, .jsonl.gz or .parquet")


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for line_number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue  # blank lines are not rows
                try:
                    yield line_number, json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    yield line_number, _Skip("bad_json", f"not UTF-8: {e}")
                except (ValueError, RecursionError) as e:
                    yield line_number, _Skip("bad_json", f"{type(e).__name__}: {str(e)[:120]}")
    except (OSError, EOFError) as e:
        raise ValueError(f"prompt file {path} cannot be read: {e}") from e


def _read_parquet(path: Path, config: DatasetConfig) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        columns = set(parquet.schema_arrow.names)
        if config.prompt_key not in columns and config.messages_key not in columns:
            raise ValueError(f"prompt file {path}: no {config.prompt_key!r} or {config.messages_key!r} column "
                             f"(columns: {sorted(columns)})")
        row_number = 0
        for batch in parquet.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                row_number += 1
                yield row_number, row
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"prompt file {path} is not a readable Parquet file: {e}") from e


def _to_sample(row: Any, path: Path, row_number: int, config: DatasetConfig) -> PromptSample:
    if not isinstance(row, dict):
        raise _Skip("not_an_object", f"row is a JSON {type(row).__name__}, not an object")
    messages = _messages(row, config)
    if not any(m["content"].strip() for m in messages if m["role"] != "system"):
        raise _Skip("empty_prompt", "the prompt has no non-blank user content")
    if config.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    _check_length(messages, config)
    return PromptSample(prompt_id=_prompt_id(row, path, row_number, config), messages=messages,
                        answer=_answer(row, config), metadata=_metadata(row, config))


def _messages(row: dict, config: DatasetConfig) -> list[dict[str, str]]:
    raw = row.get(config.messages_key)
    if raw is None:
        prompt = row.get(config.prompt_key)
        if prompt is None:
            raise _Skip("missing_field", f"neither {config.prompt_key!r} nor {config.messages_key!r} is set")
        if not isinstance(prompt, str):
            raise _Skip("wrong_type", f"{config.prompt_key!r} must be a string, got {type(prompt).__name__}")
        return [{"role": "user", "content": prompt}]
    if not isinstance(raw, list) or not raw:
        raise _Skip("wrong_type", f"{config.messages_key!r} must be a non-empty list of messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"{config.messages_key}[{i}]"
        if not isinstance(message, dict):
            raise _Skip("wrong_type", f"{where} must be an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role is None or content is None:
            raise _Skip("missing_field", f"{where} needs 'role' and 'content'")
        if role not in ROLES:
            raise _Skip("wrong_type", f"{where}.role must be one of {ROLES}, got {str(role)[:40]!r}")
        if not isinstance(content, str):
            raise _Skip("wrong_type", f"{where}.content must be a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    return messages


def _check_length(messages: list[dict[str, str]], config: DatasetConfig) -> None:
    if config.max_prompt_chars is not None:
        chars = sum(len(m["content"]) for m in messages)
        if chars > config.max_prompt_chars:
            raise _Skip("prompt_too_long", f"{chars} characters > {config.max_prompt_chars}")
    if config.count_tokens is not None and config.max_prompt_tokens is not None:
        try:
            tokens = int(config.count_tokens("\n".join(m["content"] for m in messages)))
        except Exception as e:
            raise _Skip("token_count_failed", f"count_tokens raised {type(e).__name__}: {e}") from e
        if tokens > config.max_prompt_tokens:
            raise _Skip("prompt_too_long", f"{tokens} tokens > {config.max_prompt_tokens}")


def _prompt_id(row: dict, path: Path, row_number: int, config: DatasetConfig) -> str:
    value = row.get(config.id_key)
    if value is None:
        return f"{path.name}:{row_number}"
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise _Skip("wrong_type", f"{config.id_key!r} must be a non-empty string or an integer, got {value!r:.40}")
    return str(value)


def _answer(row: dict, config: DatasetConfig) -> str | None:
    value = row.get(config.answer_key)
    if value is None:
        if config.require_answer:
            raise _Skip("missing_field", f"{config.answer_key!r} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise _Skip("wrong_type", f"{config.answer_key!r} must be a string or number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _Skip("wrong_type", f"{config.answer_key!r} must be finite, got {value}")
    return value if isinstance(value, str) else str(value)


def _metadata(row: dict, config: DatasetConfig) -> dict[str, Any]:
    value = row.get(config.metadata_key)
    if value is not None and not isinstance(value, dict):
        raise _Skip("wrong_type", f"{config.metadata_key!r} must be an object, got {type(value).__name__}")
    metadata = dict(value or {})
    for key in config.extra_metadata_keys:
        if row.get(key) is not None:
            metadata[key] = row[key]
    return metadata
