"""`training.checkpoint.files.verify_files` checks each file with the digest its table records: SHA-256 in a
run's checkpoint (sao-train-checkpoint-v1), xxh3-128 in a `sao convert hf-to-mcore` output
(sao-mcore-v2) that `actor.load` / `critic.load` may name."""

from __future__ import annotations

import hashlib

import xxhash

from megatron_sao.training.checkpoint import files


def test_verify_files_reads_sha256_and_xxh3_entries(tmp_path):
    (tmp_path / "run").write_bytes(b"trained weights")
    (tmp_path / "converted").write_bytes(b"converted weights")
    table = {"run": {"bytes": 15, "sha256": hashlib.sha256(b"trained weights").hexdigest()},
             "converted": {"bytes": 17, "xxh3_128": xxhash.xxh3_128(b"converted weights").hexdigest()}}
    assert files.verify_files(tmp_path, table, ["run", "converted"]) == []
    (tmp_path / "run").write_bytes(b"trained weightS")
    (tmp_path / "converted").write_bytes(b"converted weightS")
    assert files.verify_files(tmp_path, table, ["run", "converted"]) == [
        f"{tmp_path / 'run'}: checkpoint file is corrupt (SHA-256 differs from the one recorded at save)",
        f"{tmp_path / 'converted'}: checkpoint file is corrupt (xxh3-128 differs from the one recorded at save)"]
