"""Parquet and JSONL round-trip trajectories exactly (every field, log-probs bit for bit)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sao.rollout.trajectory import Trajectory, TrajectoryStatus
from megatron_sao.rollout.trajectory_io import (
    read_jsonl,
    read_parquet,
    trajectory_from_dict,
    trajectory_to_dict,
    write_jsonl,
    write_parquet,
)
from tests.rollout.trajectory_strategies import trajectories, two_turn

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def full_records(draw) -> Trajectory:
    traj, _ = draw(trajectories())
    traj.status = draw(st.sampled_from(list(TrajectoryStatus)))
    traj.status_reason = draw(st.text(max_size=20))
    traj.metadata = draw(st.dictionaries(st.text(max_size=6), _json_values, max_size=4))
    traj.timings.started_at = draw(st.floats(0, 2e9))
    traj.timings.finished_at = draw(st.floats(0, 2e9))
    traj.timings.generate_s = draw(st.floats(0, 1e4))
    traj.num_engine_calls = draw(st.integers(0, 100))
    traj.num_engine_retries = draw(st.integers(0, 10))
    if draw(st.booleans()) and len(traj):  # schema version 2: routed experts, some tokens not routed
        import numpy as np

        from megatron_sao.rollout.routing import NOT_ROUTED, RoutedExperts

        rng = np.random.default_rng(draw(st.integers(0, 2**16)))
        indices = np.argsort(rng.random((len(traj), draw(st.integers(1, 3)), 6)), axis=2)[:, :, :2]
        indices[rng.random(len(traj)) < 0.3] = NOT_ROUTED
        traj.routed_experts = RoutedExperts(indices)
    return traj


def _fields(traj: Trajectory) -> dict:
    out = trajectory_to_dict(traj)
    out["rollout_logprobs"] = [x.hex() for x in out["rollout_logprobs"]]  # bit-exact comparison
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(full_records(), min_size=1, max_size=5))
def test_parquet_and_jsonl_round_trip_exactly(tmp_path, records):
    write_parquet(tmp_path / "t.parquet", records)
    write_jsonl(tmp_path / "t.jsonl", records)
    for loaded in (read_parquet(tmp_path / "t.parquet"), read_jsonl(tmp_path / "t.jsonl")):
        assert [_fields(t) for t in loaded] == [_fields(t) for t in records]
        assert loaded == records  # dataclass equality: the records are the same objects' values


def test_jsonl_appends_and_reports_bad_lines(tmp_path):
    traj = two_turn()
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [traj])
    write_jsonl(path, [traj], append=True)
    assert len(read_jsonl(path)) == 2
    with open(path, "a") as f:
        f.write(json.dumps({"prompt_id": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:3"):
        read_jsonl(path)


def test_unknown_schema_version_is_refused():
    traj = two_turn()
    data = trajectory_to_dict(traj)
    data["schema_version"] = 99
    with pytest.raises(ValueError, match="schema version 99"):
        trajectory_from_dict(data)
