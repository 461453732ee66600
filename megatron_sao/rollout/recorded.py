"""Recorded trajectories as a training source: replay, debugging, training on data made elsewhere.

`RecordedTrajectories` reads a file written by `trajectory_io` (Parquet, or JSONL with one record
per line) and hands out batches of `batch_size` trajectories in file order, wrapping around at the
end (each pass is an epoch). A row that is not a valid trajectory record (unparseable, broken
invariants, a non-finite reward, a token id outside the model's vocabulary) is skipped and
counted with its file and row, like a bad prompt row (`rollout/datasets.py`); a file with no
valid row is an error. The position (trajectories handed out so far) is the whole state: same
file, same position -> same batches.

`check_trajectory_file` is the cheap check a job's parent process runs before any rank starts
or any model is built: the file exists, has a known format and at least one row, and its rows
carry every column a trajectory record needs (Parquet: the file's schema; JSONL: the first row
that is a JSON object). A token id is checked against the vocabulary where the rows are parsed
(every row, on the ranks): an id the embedding has no row for would crash a TP1 run with a bare
IndexError and be masked to zero, silently, by TP > 1's vocab-parallel embedding.

Routing (`routed_experts`, schema version 2): a row whose routing is malformed (a token mixing
routed and not-routed entries, an expert chosen twice) or does not fit the model (`routing`: its
MoE layers, top-k, expert range) is skipped and counted like any other bad row (`bad_routing`).
`with_routing=False` checks every row's routing as it is read, then drops it (the trainer ranks
that do not distribute routing: they skip the same rows as the rank that does, which alone keeps
the routing, training/routing_shards.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_sao.rollout.datasets import LoadReport, SkippedRow
from megatron_sao.rollout.routing import RoutingSpec
from megatron_sao.rollout.trajectory import Trajectory
from megatron_sao.rollout.trajectory_io import trajectory_from_dict

logger = logging.getLogger(__name__)

_LOGGED_SKIPS = 20
REQUIRED_COLUMNS = ("trajectory_id", "prompt_id", "token_ids", "loss_mask", "rollout_logprobs", "policy_versions",
                    "prompt_length", "turns", "rewards", "status", "status_reason", "timings", "num_engine_calls",
                    "num_engine_retries")
"""What `trajectory_io.trajectory_from_dict` reads from every record, besides its metadata (`metadata` in
JSONL, `metadata_json` in Parquet); `schema_version` is optional."""
_METADATA_COLUMNS = {".jsonl": "metadata", ".parquet": "metadata_json"}


def _missing_columns(columns: set[str], suffix: str) -> list[str]:
    return [c for c in (*REQUIRED_COLUMNS, _METADATA_COLUMNS[suffix]) if c not in columns]


def check_trajectory_file(path: str | Path) -> None:
    """ValueError naming the file (and the missing columns) unless `path` is a trajectory file with
    at least one row: reads the Parquet footer or the JSONL file up to its first JSON object, never
    the whole file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trajectory file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix not in _METADATA_COLUMNS:
        raise ValueError(f"trajectory file {path}: unknown format; use .parquet or .jsonl")
    if path.stat().st_size == 0:
        raise ValueError(f"trajectory file {path} is empty")
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise ValueError(f"trajectory file {path} is not a readable Parquet file: {e}") from e
        if parquet.metadata.num_rows == 0:
            raise ValueError(f"trajectory file {path} has no rows")
        columns = set(parquet.schema_arrow.names)
        where = "its schema"
    else:
        first = None
        for line_number, raw in _rows(path):
            try:
                row = json.loads(raw.decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                continue  # a bad row: skipped and counted when the file is read
            if isinstance(row, dict):
                first = (line_number, row)
                break
        if first is None:
            raise ValueError(f"trajectory file {path} has no row that is a JSON object (a trajectory record)")
        columns = set(first[1])
        where = f"its first record (line {first[0]})"
    if missing := _missing_columns(columns, suffix):
        raise ValueError(f"trajectory file {path} is not a trajectory file: {where} lacks the column(s) "
                         f"{', '.join(missing)} (written by `trajectory_io`? see docs/training.md)")


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    name = path.name.lower()
    if name.endswith(".jsonl"):
        with path.open("rb") as f:
            for line_number, raw in enumerate(f, start=1):
                if raw.strip():
                    yield line_number, raw
    elif name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
            row_number = 0
            for batch in parquet.iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    row_number += 1
                    yield row_number, row
        except (OSError, pa.ArrowException) as e:
            raise ValueError(f"trajectory file {path} is not a readable Parquet file: {e}") from e
    else:
        raise ValueError(f"trajectory file {path}: unknown format; use .parquet or .jsonl")


def _check_vocabulary(traj: Trajectory, vocab_size: int) -> None:
    bad = [(i, t) for i, t in enumerate(traj.token_ids) if not 0 <= t < vocab_size]
    if bad:
        position, token = bad[0]
        raise ValueError(f"token id {token} at position {position} is outside the model's vocabulary [0, {vocab_size})"
                         + (f" ({len(bad)} such ids)" if len(bad) > 1 else ""))


def _parse(raw: Any) -> Trajectory:
    row = json.loads(raw.decode("utf-8")) if isinstance(raw, bytes) else raw
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, not a trajectory object")
    row = dict(row)
    if "metadata_json" in row:  # the Parquet layout stores metadata as JSON text
        row["metadata"] = json.loads(row.pop("metadata_json") or "{}")
    traj = trajectory_from_dict(row)
    traj.validate()  # every invariant, non-finite rewards included
    return traj


def load_trajectories(path: str | Path, routing: RoutingSpec | None = None, with_routing: bool = True,
                      vocab_size: int | None = None) -> tuple[list[Trajectory], LoadReport]:
    """Every valid trajectory of `path`, in file order, and the report of what was skipped. With
    `vocab_size`, a row with a token id outside [0, vocab_size) is skipped too (`out_of_vocabulary`);
    with `routing`, a row whose `routed_experts` does not fit that layout is skipped (`bad_routing`);
    `with_routing=False` drops every row's routing once checked."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trajectory file {path} does not exist")
    report = LoadReport()
    out = []
    for row_number, raw in _rows(path):
        report.num_rows += 1
        reason = "bad_record"
        try:
            traj = _parse(raw)
            if vocab_size is not None:
                reason = "out_of_vocabulary"
                _check_vocabulary(traj, vocab_size)
            if routing is not None and traj.routed_experts is not None:
                reason = "bad_routing"
                routing.check(traj.routed_experts)
            if not with_routing:
                traj.routed_experts = None
            out.append(traj)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            if "routed_experts" in str(e):
                reason = "bad_routing"
            report.counts[reason] += 1
            report.skipped.append(SkippedRow(str(path), row_number, reason, str(e)[:300]))
            level = logging.WARNING if report.num_skipped <= _LOGGED_SKIPS else logging.DEBUG
            logger.log(level, "skipping %s row %d: %s", path, row_number, str(e)[:300])
    report.num_loaded = len(out)
    if not out:
        raise ValueError(f"trajectory file {path} has no valid trajectory ({report.summary()})")
    return out, report


class RecordedTrajectories:
    """Batches of `batch_size` recorded trajectories in file order, wrapping around at the end."""

    def __init__(self, path: str | Path, batch_size: int, routing: RoutingSpec | None = None,
                 with_routing: bool = True, vocab_size: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path = Path(path)
        self.trajectories, self.report = load_trajectories(self.path, routing, with_routing, vocab_size)
        self.batch_size = batch_size
        self.position = 0

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def epoch(self) -> float:
        return self.position / len(self.trajectories)

    def next_batch(self) -> list[Trajectory]:
        n = len(self.trajectories)
        batch = [self.trajectories[(self.position + i) % n] for i in range(self.batch_size)]
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "position": self.position, "num_trajectories": len(self.trajectories)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_trajectories"] != len(self.trajectories):
            logger.warning("resuming %s at position %d: the file now holds %d valid trajectories, it held %d",
                           self.path, state["position"], len(self.trajectories), state["num_trajectories"])
        self.position = int(state["position"])
