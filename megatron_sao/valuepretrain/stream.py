"""Streaming the training split by Parquet row group: never loaded whole, shuffled by seed, resumable.

The unit of reading is one row group of one shard. Epoch `e` shuffles all units with
`Random(f"{seed}:{e}")`; data-parallel rank `r` of `d` takes units `r, r + d, r + 2d, ...` of that
order (each rank reads its own row groups, no file is read twice in an epoch), and shuffles the
valid rows of each unit with `Random(f"{seed}:{e}:{shard}:{row_group}")`. A rank's stream is
therefore a pure function of (corpus, seed, dp rank, dp size), and its position
`(epoch, unit, row)` is all a checkpoint needs to continue it mid-epoch exactly. Ranks move on to
their next epoch on their own (row groups need not hold equal counts of valid rows).

Legend: a "unit" is one (shard, row group); `row` counts valid rows already handed out of the
current unit, in its shuffled order.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path
from typing import Any

from megatron_sao.rollout.datasets import LoadReport
from megatron_sao.rollout.trajectory import Trajectory
from megatron_sao.valuepretrain.check import (
    BadShardError,
    ShardProblem,
    handle_bad_shards,
    parse_rows,
    read_row_group,
)
from megatron_sao.valuepretrain.corpus import ShardInfo

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Unit:
    shard: str
    row_group: int
    first_row: int
    """1-based number, within the shard, of the unit's first row (for reports)."""
    num_rows: int


def plan_units(shards: list[ShardInfo]) -> list[Unit]:
    """Every row group of `shards`, in file order."""
    units = []
    for info in sorted(shards, key=lambda s: s.name):
        first = 1
        for index, rows in enumerate(info.row_groups):
            units.append(Unit(info.name, index, first, rows))
            first += rows
    return units


def rank_units(units: list[Unit], seed: int, epoch: int, dp_rank: int, dp_size: int) -> list[Unit]:
    """This rank's units of `epoch`, in reading order."""
    order = list(units)
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order[dp_rank::dp_size]


class RankStream:
    """This data-parallel rank's endless stream of training trajectories."""

    def __init__(self, corpus_dir: str | Path, shards: list[ShardInfo], seed: int, dp_rank: int, dp_size: int,
                 on_bad_shard: str = "stop") -> None:
        self.corpus_dir = Path(corpus_dir)
        self.units = plan_units(shards)
        if len(self.units) < dp_size:
            raise ValueError(f"corpus {self.corpus_dir}: {len(self.units)} training row groups for {dp_size} "
                             "data-parallel ranks; each rank needs at least one (write the corpus with a smaller "
                             "value_pretrain.row_group_size)")
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.on_bad_shard = on_bad_shard
        self.report = LoadReport()
        self.bad_units: list[ShardProblem] = []
        self.epoch = self.unit = self.row = 0
        self._order = rank_units(self.units, seed, 0, dp_rank, dp_size)
        self._rows: list[Trajectory] | None = None
        self._parsed: set[tuple[str, int]] = set()

    # ---- reading ------------------------------------------------------------------------------

    def next_batch(self, size: int) -> list[Trajectory]:
        out: list[Trajectory] = []
        empty_units = 0
        while len(out) < size:
            rows = self._current_rows()
            if self.row >= len(rows):
                empty_units = empty_units + 1 if not rows else 0
                if empty_units > 2 * len(self._order) + 1:
                    raise ValueError(f"corpus {self.corpus_dir}: data-parallel rank {self.dp_rank} found no valid "
                                     f"row in any of its row groups ({self.report.summary()})")
                self._advance()
                continue
            take = min(size - len(out), len(rows) - self.row)
            out.extend(rows[self.row:self.row + take])
            self.row += take
        return out

    def _advance(self) -> None:
        self.unit += 1
        self.row = 0
        self._rows = None
        if self.unit >= len(self._order):
            self.epoch += 1
            self.unit = 0
            self._order = rank_units(self.units, self.seed, self.epoch, self.dp_rank, self.dp_size)

    def _current_rows(self) -> list[Trajectory]:
        if self._rows is None:
            self._rows = self._load(self._order[self.unit])
        return self._rows

    def _load(self, unit: Unit) -> list[Trajectory]:
        key = (unit.shard, unit.row_group)
        if any((p.name, p.row_group) == key for p in self.bad_units):
            return []
        path = self.corpus_dir / unit.shard
        try:
            raw = read_row_group(path, unit.row_group)
        except ValueError as e:
            problem = ShardProblem(unit.shard, "unreadable", str(e), unit.row_group)
            self.bad_units.append(problem)
            handle_bad_shards([problem], self.on_bad_shard)
            return []
        # Skipped rows are reported once per process, not once per epoch.
        report = self.report if key not in self._parsed else LoadReport()
        self._parsed.add(key)
        rows = [traj for _, traj in parse_rows(raw, str(path), unit.first_row, report)]
        random.Random(f"{self.seed}:{self.epoch}:{unit.shard}:{unit.row_group}").shuffle(rows)
        return rows

    @property
    def epoch_progress(self) -> float:
        """Epochs completed, fractional (by units of this rank)."""
        return self.epoch + self.unit / len(self._order)

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "unit": self.unit, "row": self.row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.unit, self.row = int(state["epoch"]), int(state["unit"]), int(state["row"])
        self._order = rank_units(self.units, self.seed, self.epoch, self.dp_rank, self.dp_size)
        if not 0 <= self.unit < len(self._order):
            raise ValueError(f"stream position {state} does not fit this corpus ({len(self._order)} row groups for "
                             f"rank {self.dp_rank}): was the corpus changed since the checkpoint?")
        self._rows = None


def read_split(corpus_dir: str | Path, shards: list[ShardInfo], max_trajectories: int, report: LoadReport,
               on_bad_shard: str = "stop") -> list[Trajectory]:
    """The first `max_trajectories` valid trajectories of `shards` in file order (the held-out set:
    small, read whole by every rank, always the same trajectories)."""
    corpus_dir = Path(corpus_dir)
    out: list[Trajectory] = []
    for unit in plan_units(shards):
        if len(out) >= max_trajectories:
            break
        path = corpus_dir / unit.shard
        try:
            raw = read_row_group(path, unit.row_group)
        except ValueError as e:
            handle_bad_shards([ShardProblem(unit.shard, "unreadable", str(e), unit.row_group)], on_bad_shard)
            continue
        out.extend(traj for _, traj in parse_rows(raw, str(path), unit.first_row, report))
    return out[:max_trajectories]


__all__ = ["BadShardError", "RankStream", "Unit", "plan_units", "rank_units", "read_split"]
