"""Trajectory serialisation: JSONL (debugging, small corpora) and Parquet (value-pretraining
corpora), both exact: a record read back equals the record written, field by field, log-probs bit
for bit (floats are stored as float64 / Python `repr`, which round-trip).

The Parquet schema is flat and typed (list columns for the per-token arrays, structs for turns,
rewards and timings); `metadata` is stored as a JSON string because its shape varies between
environments. `SCHEMA_VERSION` is written with every row so that a later change can be read
side by side with old corpora.

Schema versions: 1 (no routing); 2 adds `routed_experts` (rollout/routing.py): in JSONL one entry
per token, `[moe_layers][topk]` expert indices or null (not routed), null for a trajectory without
routing; in Parquet the int16 column `routed_experts` (the `[n, L, k]` indices in C order, a token
that was not routed stored as -1 entries) with `routed_experts_layers` and `routed_experts_topk`
(int16), all null without routing. Version-1 files read as trajectories without routing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megatron_sao.rollout.routing import RoutedExperts
from megatron_sao.rollout.trajectory import (
    FinishType,
    Reward,
    RewardKind,
    Timings,
    Trajectory,
    TrajectoryStatus,
    Turn,
)

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
_ROUTING_SHAPE_KEYS = ("routed_experts_layers", "routed_experts_topk")


def trajectory_to_dict(traj: Trajectory, with_routing: bool = True) -> dict[str, Any]:
    """A JSON-ready dict (enums as their string values); `routed_experts` as lists unless
    `with_routing` is False (the Parquet writer stores it as arrays)."""
    out = {
        "schema_version": SCHEMA_VERSION,
        "trajectory_id": traj.trajectory_id,
        "prompt_id": traj.prompt_id,
        "token_ids": list(traj.token_ids),
        "loss_mask": list(traj.loss_mask),
        "rollout_logprobs": list(traj.rollout_logprobs),
        "policy_versions": list(traj.policy_versions),
        "prompt_length": traj.prompt_length,
        "turns": [
            {
                "action_start": t.action_start,
                "action_end": t.action_end,
                "observation_end": t.observation_end,
                "finish_type": str(t.finish_type),
            }
            for t in traj.turns
        ],
        "rewards": [
            {"value": r.value, "position": r.position, "kind": str(r.kind), "turn": r.turn} for r in traj.rewards
        ],
        "status": str(traj.status),
        "status_reason": traj.status_reason,
        "timings": {
            "started_at": traj.timings.started_at,
            "finished_at": traj.timings.finished_at,
            "generate_s": traj.timings.generate_s,
            "env_s": traj.timings.env_s,
        },
        "num_engine_calls": traj.num_engine_calls,
        "num_engine_retries": traj.num_engine_retries,
        "metadata": traj.metadata,
    }
    if with_routing:
        out["routed_experts"] = None if traj.routed_experts is None else traj.routed_experts.to_lists()
    return out


def routing_from_dict(data: dict[str, Any]) -> RoutedExperts | None:
    """`routed_experts` of a record in either layout (JSONL lists, or Parquet's flat column with
    its shape columns); None when absent or null."""
    value = data.get("routed_experts")
    if value is None:
        return None
    if any(key in data for key in _ROUTING_SHAPE_KEYS):
        layers, topk = (data.get(key) for key in _ROUTING_SHAPE_KEYS)
        if not isinstance(layers, int) or not isinstance(topk, int):
            raise ValueError(f"routed_experts needs integer routed_experts_layers / routed_experts_topk, got "
                             f"{layers!r} / {topk!r}")
        routed = RoutedExperts.from_flat(np.asarray(value, dtype=np.int64), layers, topk)
    elif isinstance(value, list):
        routed = RoutedExperts.from_lists(value)
    else:
        raise ValueError(f"routed_experts must be a list (one entry per token) or null, got {type(value).__name__}")
    return routed


def trajectory_from_dict(data: dict[str, Any]) -> Trajectory:
    version = data.get("schema_version", SCHEMA_VERSION)
    if version not in READABLE_VERSIONS:
        raise ValueError(f"trajectory schema version {version} is not supported (this code reads "
                         f"{', '.join(map(str, READABLE_VERSIONS))})")
    if version == 1 and data.get("routed_experts") is not None:
        raise ValueError("a schema version 1 record cannot carry routed_experts (version 2 added them)")
    return Trajectory(
        trajectory_id=str(data["trajectory_id"]),
        prompt_id=str(data["prompt_id"]),
        token_ids=[int(x) for x in data["token_ids"]],
        loss_mask=[int(x) for x in data["loss_mask"]],
        rollout_logprobs=[float(x) for x in data["rollout_logprobs"]],
        policy_versions=[int(x) for x in data["policy_versions"]],
        prompt_length=int(data["prompt_length"]),
        turns=[
            Turn(
                int(t["action_start"]),
                int(t["action_end"]),
                int(t["observation_end"]),
                FinishType(t["finish_type"]),
            )
            for t in data["turns"]
        ],
        rewards=[
            Reward(float(r["value"]), int(r["position"]), RewardKind(r["kind"]), int(r["turn"]))
            for r in data["rewards"]
        ],
        status=TrajectoryStatus(data["status"]),
        status_reason=str(data["status_reason"]),
        timings=Timings(**{k: float(v) for k, v in data["timings"].items()}),
        num_engine_calls=int(data["num_engine_calls"]),
        num_engine_retries=int(data["num_engine_retries"]),
        metadata=dict(data["metadata"]),
        routed_experts=routing_from_dict(data),
    )


# ---- JSONL ----------------------------------------------------------------------------------


def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory], append: bool = False) -> int:
    """Write one JSON object per line; returns the number written."""
    count = 0
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for traj in trajectories:
            f.write(json.dumps(trajectory_to_dict(traj), ensure_ascii=False))
            f.write("\n")
            count += 1
    return count


def iter_jsonl(path: str | Path) -> Iterator[Trajectory]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield trajectory_from_dict(json.loads(line))
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trajectory record: {e}") from e


def read_jsonl(path: str | Path) -> list[Trajectory]:
    return list(iter_jsonl(path))


# ---- Parquet --------------------------------------------------------------------------------


def parquet_schema():  # -> pyarrow.Schema
    import pyarrow as pa

    return pa.schema(
        [
            ("schema_version", pa.int32()),
            ("trajectory_id", pa.string()),
            ("prompt_id", pa.string()),
            ("token_ids", pa.list_(pa.int64())),
            ("loss_mask", pa.list_(pa.int8())),
            ("rollout_logprobs", pa.list_(pa.float64())),
            ("policy_versions", pa.list_(pa.int64())),
            ("prompt_length", pa.int64()),
            (
                "turns",
                pa.list_(
                    pa.struct(
                        [
                            ("action_start", pa.int64()),
                            ("action_end", pa.int64()),
                            ("observation_end", pa.int64()),
                            ("finish_type", pa.string()),
                        ]
                    )
                ),
            ),
            (
                "rewards",
                pa.list_(
                    pa.struct(
                        [
                            ("value", pa.float64()),
                            ("position", pa.int64()),
                            ("kind", pa.string()),
                            ("turn", pa.int64()),
                        ]
                    )
                ),
            ),
            ("status", pa.string()),
            ("status_reason", pa.string()),
            (
                "timings",
                pa.struct(
                    [
                        ("started_at", pa.float64()),
                        ("finished_at", pa.float64()),
                        ("generate_s", pa.float64()),
                        ("env_s", pa.float64()),
                    ]
                ),
            ),
            ("num_engine_calls", pa.int64()),
            ("num_engine_retries", pa.int64()),
            ("metadata_json", pa.string()),
            ("routed_experts", pa.list_(pa.int16())),
            ("routed_experts_layers", pa.int16()),
            ("routed_experts_topk", pa.int16()),
        ]
    )


def _routing_columns(trajectories: list[Trajectory]):  # -> three pyarrow.Arrays
    """The routing columns built from the int16 arrays directly (no Python lists of ints)."""
    import pyarrow as pa

    routed = [t.routed_experts for t in trajectories]
    flats = [r.to_flat() if r is not None else np.zeros(0, dtype=np.int16) for r in routed]
    offsets = np.zeros(len(flats) + 1, dtype=np.int32)
    np.cumsum([f.size for f in flats], out=offsets[1:])
    missing = np.array([r is None for r in routed], dtype=bool)
    values = pa.array(np.concatenate(flats) if flats else np.zeros(0, dtype=np.int16), type=pa.int16())
    column = pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(missing))
    layers = pa.array([None if r is None else r.num_layers for r in routed], type=pa.int16())
    topk = pa.array([None if r is None else r.topk for r in routed], type=pa.int16())
    return column, layers, topk


def trajectories_to_table(trajectories: Iterable[Trajectory]):  # -> pyarrow.Table
    import pyarrow as pa

    trajectories = list(trajectories)
    rows = []
    for traj in trajectories:
        row = trajectory_to_dict(traj, with_routing=False)
        row["metadata_json"] = json.dumps(row.pop("metadata"), ensure_ascii=False, sort_keys=True)
        rows.append(row)
    schema = parquet_schema()
    plain = pa.schema([f for f in schema if not f.name.startswith("routed_experts")])
    table = pa.Table.from_pylist(rows, schema=plain)
    for name, column in zip(("routed_experts", *_ROUTING_SHAPE_KEYS), _routing_columns(trajectories), strict=True):
        table = table.append_column(schema.field(name), column)
    return table


def table_to_trajectories(table) -> list[Trajectory]:
    out = []
    for row in table.to_pylist():
        row["metadata"] = json.loads(row.pop("metadata_json"))
        out.append(trajectory_from_dict(row))
    return out


def write_parquet(path: str | Path, trajectories: Iterable[Trajectory]) -> int:
    """Write one Parquet file; returns the number of rows."""
    import pyarrow.parquet as pq

    table = trajectories_to_table(trajectories)
    pq.write_table(table, str(path))
    return table.num_rows


def read_parquet(path: str | Path) -> list[Trajectory]:
    import pyarrow.parquet as pq

    return table_to_trajectories(pq.read_table(str(path)))
