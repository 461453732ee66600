"""The routed-experts record (R3): the per-token layout, its checks, the keep-first rule of the
agent loop, SGLang 0.5.23's wire encoding (against SGLang's own decoder), the MoE layers of every
model family, and the trajectory files' schema version 2 (version 1 still read)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_sao.models.tiny_hf import supported_families, tiny_hf_config
from megatron_sao.rollout.recorded import load_trajectories
from megatron_sao.rollout.routing import (
    NOT_ROUTED,
    RoutedExperts,
    RoutingSpec,
    decode_sglang_routed_experts,
    encode_sglang_routed_experts,
    moe_layer_indices,
    routing_spec_from_hf_config,
)
from megatron_sao.rollout.trajectory_io import (
    parquet_schema,
    read_jsonl,
    read_parquet,
    trajectory_to_dict,
    write_jsonl,
    write_parquet,
)
from tests.training.trajectories import random_trajectories, with_random_routing


def test_record_checks_name_the_bad_token():
    good = np.array([[[0, 1], [2, 3]], [[NOT_ROUTED] * 2] * 2])
    RoutedExperts(good).check(num_experts=4)
    partial = good.copy()
    partial[1, 0, 0] = 2
    with pytest.raises(ValueError, match=r"routed_experts\[1\] mixes experts"):
        RoutedExperts(partial).check()
    with pytest.raises(ValueError, match=r"routed_experts\[0\] has expert index 3 outside \[0, 3\)"):
        RoutedExperts(good).check(num_experts=3)
    twice = good.copy()
    twice[0, 1] = [2, 2]
    with pytest.raises(ValueError, match=r"routed_experts\[0\] chooses the same expert twice"):
        RoutedExperts(twice).check()
    with pytest.raises(ValueError, match="must be expert indices"):
        RoutedExperts(np.full((1, 1, 2), 40000))
    assert RoutedExperts(good).routed_mask().tolist() == [True, False]
    assert RoutedExperts(good) == RoutedExperts(good.astype(np.int16)) != RoutedExperts(twice)


def test_json_form_round_trips_and_refuses_ragged_entries():
    routed = RoutedExperts(np.array([[[0, 1]], [[NOT_ROUTED] * 2], [[3, 2]]]))
    assert routed.to_lists() == [[[0, 1]], None, [[3, 2]]]
    assert RoutedExperts.from_lists(routed.to_lists()) == routed
    with pytest.raises(ValueError, match=r"routed_experts\[1\] has shape \(1, 3\)"):
        RoutedExperts.from_lists([[[0, 1]], [[0, 1, 2]]])
    with pytest.raises(ValueError, match="negative expert index"):
        RoutedExperts.from_lists([[[0, -1]]])
    flat = routed.to_flat()
    assert flat.dtype == np.int16 and RoutedExperts.from_flat(flat, 1, 2) == routed


def test_a_token_keeps_the_routing_of_the_forward_that_first_computed_it():
    traj = random_trajectories(1, seed=0)[0]
    n = len(traj)
    first = np.broadcast_to(np.array([0, 1]), (n - 1, 2, 2))
    traj.record_routing(0, first[: n // 2])  # a call that was aborted half-way
    again = np.broadcast_to(np.array([2, 3]), (n - 1, 2, 2))  # the resumed call recomputed everything
    traj.record_routing(0, again)
    rows = traj.routed_experts.indices_nlk
    assert (rows[: n // 2] == [0, 1]).all() and (rows[n // 2: n - 1] == [2, 3]).all()
    traj.finish(traj.status)  # the last token is never fed to an engine: padded as not routed
    assert traj.routed_experts.num_tokens == n and not traj.routed_experts.routed_mask()[-1]
    traj.validate()
    with pytest.raises(ValueError, match="beyond the trajectory"):
        traj.record_routing(n - 1, np.zeros((2, 2, 2), dtype=np.int64))


def test_sglang_wire_format_matches_sglangs_own_decoder():
    pytest.importorskip("sglang")
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    spec = RoutingSpec(num_layers=3, moe_layers=(1, 2), topk=2, num_experts=8)
    full = np.random.default_rng(0).integers(0, 8, size=(5, 3, 2)).astype(np.int32)
    full[:, 0] = 0  # a dense layer: never captured by SGLang
    encoded = encode_sglang_routed_experts(full)
    assert (extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": encoded}}) == full.ravel()).all()
    assert (decode_sglang_routed_experts(encoded, spec, 5) == full[:, 1:]).all()
    with pytest.raises(ValueError, match="expected 4 positions"):
        decode_sglang_routed_experts(encoded, spec, 4)
    with pytest.raises(ValueError, match="outside"):
        decode_sglang_routed_experts(encode_sglang_routed_experts(full + 8), spec, 5)


@pytest.mark.parametrize("family", supported_families())
def test_moe_layers_are_the_ones_transformers_builds(family):
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(family)
    model = AutoModelForCausalLM.from_config(config)
    built = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    as_json = config.to_dict()
    assert moe_layer_indices(as_json) == built
    spec = routing_spec_from_hf_config(as_json)
    assert spec.moe_layers == tuple(built) and spec.num_layers == len(model.model.layers)
    assert spec.topk == config.num_experts_per_tok


def test_qwen3_sparse_step_and_dense_layers():
    base = {"num_hidden_layers": 6, "num_experts": 8, "num_experts_per_tok": 2}
    assert moe_layer_indices({**base, "decoder_sparse_step": 2}) == [1, 3, 5]
    assert moe_layer_indices({**base, "mlp_only_layers": [0, 4]}) == [1, 2, 3, 5]
    assert moe_layer_indices({"num_hidden_layers": 4, "intermediate_size": 8}) == []
    assert routing_spec_from_hf_config({"num_hidden_layers": 4}) is None


# ---- files: schema version 2, version 1 still read, bad routing rows rejected -----------------

def _routed(num: int = 5, seed: int = 0):
    return with_random_routing(random_trajectories(num, seed=seed), seed=seed, unrouted_every=3)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_routing_round_trips_exactly(tmp_path, suffix):
    records = _routed()
    assert any(t.routed_experts is None for t in records) and any(t.routed_experts is not None for t in records)
    path = tmp_path / f"t{suffix}"
    (write_parquet if suffix == ".parquet" else write_jsonl)(path, records)
    assert (read_parquet if suffix == ".parquet" else read_jsonl)(path) == records


def test_parquet_stores_routing_as_int16_columns(tmp_path):
    write_parquet(tmp_path / "t.parquet", _routed())
    schema = pq.read_schema(tmp_path / "t.parquet")
    assert schema.field("routed_experts").type == pa.list_(pa.int16())
    assert schema.field("routed_experts_layers").type == schema.field("routed_experts_topk").type == pa.int16()
    table = pq.read_table(tmp_path / "t.parquet")
    assert set(table.column("schema_version").to_pylist()) == {2}


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_version_1_files_still_load(tmp_path, suffix):
    records = random_trajectories(3, seed=4)
    rows = []
    for traj in records:
        row = trajectory_to_dict(traj, with_routing=False)
        row["schema_version"] = 1
        rows.append(row)
    path = tmp_path / f"v1{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:  # the version-1 layout: no routing columns at all
        v1 = pa.schema([f for f in parquet_schema() if not f.name.startswith("routed_experts")])
        for row in rows:
            row["metadata_json"] = json.dumps(row.pop("metadata"))
        pq.write_table(pa.Table.from_pylist(rows, schema=v1), path)
    loaded, report = load_trajectories(path)
    assert loaded == records and report.num_skipped == 0
    assert all(t.routed_experts is None for t in loaded)


def test_bad_routing_rows_are_rejected_with_file_and_row(tmp_path):
    good = with_random_routing(random_trajectories(4, seed=1), seed=1)
    spec = RoutingSpec(num_layers=2, moe_layers=(0, 1), topk=2, num_experts=4)
    rows = [trajectory_to_dict(t) for t in good]
    rows[1]["routed_experts"][1] = [[0, 1]]  # one layer where the others have two
    rows[2]["routed_experts"][1] = [[0, 9], [1, 2]]  # expert 9 of 4
    short = trajectory_to_dict(good[3])
    short["routed_experts"] = short["routed_experts"][:-1]  # one entry short of the tokens
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [rows[0], rows[1], rows[2], short]))
    loaded, report = load_trajectories(path, routing=spec)
    assert [t.trajectory_id for t in loaded] == [good[0].trajectory_id]
    assert [(s.row, s.reason) for s in report.skipped] == [(2, "bad_routing"), (3, "bad_routing"),
                                                           (4, "bad_routing")]
    assert all(s.path == str(path) for s in report.skipped)
    assert "routed_experts[1] has shape (1, 2)" in report.skipped[0].detail
    assert "expert index 9 outside [0, 4)" in report.skipped[1].detail
    assert "routed_experts has" in report.skipped[2].detail and "entries for" in report.skipped[2].detail
    # A rank that does not keep routing skips the same rows and holds none.
    dropped, report_b = load_trajectories(path, routing=spec, with_routing=False)
    assert [t.trajectory_id for t in dropped] == [good[0].trajectory_id] and dropped[0].routed_experts is None
    assert report_b.num_skipped == 3
