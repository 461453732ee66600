"""Bad input in a corpus: shards that cannot be trusted, rows that are not valid trajectories.

Shards are checked before training (collectively: each rank hashes a share of them, findings are
gathered, so every rank agrees on the set of usable shards): missing, SHA-256 different from the
manifest, no readable Parquet footer, or row groups that disagree with the manifest. What happens
to such a shard is `value_pretrain.on_bad_shard`: "skip" (reported, the run goes on without it)
or "stop" (ValueError naming every bad shard). A row group that fails to decode while streaming
(corruption the hash check did not run for) is handled the same way, on the rank reading it.

Rows are parsed one by one; a row that is not a valid trajectory record (unparseable, token /
mask / log-prob lengths that disagree, a non-finite reward, broken turn invariants) is skipped
and recorded with its shard and 1-based row number in a `LoadReport`, like bad prompt rows
(`rollout/datasets.py`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from megatron_sao.rollout.datasets import LoadReport, SkippedRow
from megatron_sao.rollout.trajectory import Trajectory
from megatron_sao.rollout.trajectory_io import trajectory_from_dict
from megatron_sao.valuepretrain.corpus import ShardInfo, sha256_file

logger = logging.getLogger(__name__)

ROW_SKIP_REASONS = ("bad_record", "length_mismatch", "non_finite_reward", "invalid_record")
_PER_TOKEN = ("loss_mask", "rollout_logprobs", "policy_versions")
_LOGGED = 20


@dataclasses.dataclass(frozen=True, slots=True)
class ShardProblem:
    """A shard (or one of its row groups, `row_group` >= 0) that cannot be used."""

    name: str
    reason: str
    """missing | hash_mismatch | unreadable | row_groups_mismatch"""
    detail: str
    row_group: int = -1


class BadShardError(ValueError):
    """`on_bad_shard=stop` and a shard is bad."""


def check_shard(corpus_dir: Path, info: ShardInfo, verify_hash: bool) -> ShardProblem | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = corpus_dir / info.name
    if not path.is_file():
        return ShardProblem(info.name, "missing", f"{path} does not exist")
    if verify_hash:
        digest = sha256_file(path)
        if digest != info.sha256:
            return ShardProblem(info.name, "hash_mismatch", f"{path}: SHA-256 {digest[:16]}..., manifest says "
                                                            f"{info.sha256[:16]}... ({path.stat().st_size} bytes, "
                                                            f"manifest {info.num_bytes})")
    try:
        metadata = pq.ParquetFile(path).metadata
    except (OSError, pa.ArrowException) as e:
        return ShardProblem(info.name, "unreadable", f"{path}: {str(e)[:200]}")
    groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    if groups != info.row_groups:
        return ShardProblem(info.name, "row_groups_mismatch", f"{path}: row groups {groups[:8]}..., manifest "
                                                               f"{info.row_groups[:8]}...")
    return None


def check_shards(corpus_dir: Path, shards: list[ShardInfo], verify_hash: bool) -> list[ShardProblem]:
    """Collective when torch.distributed is initialised (every rank must call it): each rank checks
    every world_size-th shard, and every rank returns all findings, sorted by shard name."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine = [p for i, info in enumerate(shards) if i % world == rank
            if (p := check_shard(corpus_dir, info, verify_hash)) is not None]
    if not distributed:
        return sorted(mine, key=lambda p: p.name)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return sorted((p for part in gathered for p in part), key=lambda p: p.name)


def handle_bad_shards(problems: list[ShardProblem], policy: str) -> None:
    """Log every problem; raise `BadShardError` listing them when `policy` is "stop"."""
    for problem in problems:
        logger.warning("corpus shard %s%s is bad (%s): %s", problem.name,
                       f" row group {problem.row_group}" if problem.row_group >= 0 else "", problem.reason,
                       problem.detail)
    if problems and policy == "stop":
        listed = "; ".join(f"{p.name}: {p.reason} ({p.detail})" for p in problems[:10])
        raise BadShardError(f"{len(problems)} bad corpus shard(s): {listed}. Regenerate them (`sao value-pretrain "
                            "generate` rewrites shards missing from the manifest) or set "
                            "value_pretrain.on_bad_shard=skip to train without them")


def parse_row(row: dict[str, Any]) -> Trajectory:
    """One Parquet row -> a validated trajectory; `_RowError` carries the skip reason."""
    try:
        row = dict(row)
        row["metadata"] = json.loads(row.pop("metadata_json", None) or "{}")
        traj = trajectory_from_dict(row)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _RowError("bad_record", f"{type(e).__name__}: {e}") from e
    n = len(traj.token_ids)
    for name in _PER_TOKEN:
        if len(getattr(traj, name)) != n:
            raise _RowError("length_mismatch", f"{name} has {len(getattr(traj, name))} entries for {n} tokens")
    bad = [r.value for r in traj.rewards if not math.isfinite(r.value)]
    if bad:
        raise _RowError("non_finite_reward", f"reward {bad[0]}")
    try:
        traj.validate()
    except ValueError as e:
        raise _RowError("invalid_record", str(e)) from e
    return traj


class _RowError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        assert reason in ROW_SKIP_REASONS, reason
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def parse_rows(rows: list[dict[str, Any]], path: str, first_row: int, report: LoadReport,
               max_recorded: int = 10_000) -> list[tuple[int, Trajectory]]:
    """Valid rows as (1-based row number in the shard, trajectory); the rest counted in `report`."""
    out = []
    for offset, row in enumerate(rows):
        number = first_row + offset
        report.num_rows += 1
        try:
            out.append((number, parse_row(row)))
        except _RowError as e:
            report.counts[e.reason] += 1
            if len(report.skipped) < max_recorded:
                report.skipped.append(SkippedRow(path, number, e.reason, e.detail[:300]))
            level = logging.WARNING if report.num_skipped <= _LOGGED else logging.DEBUG
            logger.log(level, "skipping %s row %d: %s (%s)", path, number, e.reason, e.detail[:300])
            continue
        report.num_loaded += 1
    return out


def read_row_group(path: Path, row_group: int) -> list[dict[str, Any]]:
    """Decode one row group; OSError / ArrowException become `ValueError` naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).read_row_group(row_group).to_pylist()
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path} row group {row_group}: {str(e)[:200]}") from e
