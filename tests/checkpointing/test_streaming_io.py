"""The bounded I/O pieces on their own: HF read-ahead, the writer's byte budget, split checksums."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_sao.checkpointing.hashing_file import HashingFile
from megatron_sao.checkpointing.manifest import Manifest, checksum_share
from megatron_sao.models.hf_files import HFCheckpoint
from tests.checkpointing._helpers import safetensors_reference as _reference
from tests.checkpointing._helpers import small_hf_checkpoint

KB = 1024


@pytest.fixture
def checkpoint(tmp_path: Path) -> HFCheckpoint:
    return small_hf_checkpoint(tmp_path)


def _wait_until_idle(source, ready: int | None = None, timeout_s: float = 30.0) -> None:
    """Until the read-ahead thread is blocked on the budget or done (with `ready` tensors read
    ahead, when given: a thread not yet started is idle too, so a busy host needs the count)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with source._cond:
            if source._reading is None and (ready is None or len(source._ready) >= ready):
                time.sleep(0.05)
                with source._cond:
                    if source._reading is None:
                        return
        time.sleep(0.01)


@pytest.mark.parametrize("fastio", [False, True], ids=["standard", "fastio"])
def test_read_ahead_returns_exact_tensors_within_the_bucket(checkpoint, fastio):
    from megatron_sao.checkpointing.hf_reader import PrefetchingSource

    reference = _reference(checkpoint)
    order = [f"layer.{i}.w" for i in range(8)] + ["big", "ids", "empty"]
    source = PrefetchingSource(checkpoint, bucket_bytes=2 * KB, fastio=fastio)
    read: list[int] = []
    source.on_bytes = read.append
    try:
        source.start(order)
        _wait_until_idle(source, ready=4)
        assert source._buffered <= 2 * KB and len(source._ready) == 4  # 4 x 512 B, then it waits
        got = {}
        for name in order:
            got.update(source.load_tensors([name]))
    finally:
        source.close()
    assert source.peak_buffered <= 2 * KB or source.peak_buffered == checkpoint.tensors["big"].nbytes
    for name in order:
        assert got[name].dtype == reference[name].dtype and torch.equal(got[name], reference[name]), name
    assert sum(read) == sum(checkpoint.tensors[n].nbytes for n in order)  # each read once
    assert "layer.3.w" in source.get_all_keys() and "nope" not in source.get_all_keys()


def test_a_tensor_asked_for_out_of_order_or_twice_is_read_on_the_spot(checkpoint):
    from megatron_sao.checkpointing.hf_reader import PrefetchingSource

    reference = _reference(checkpoint)
    order = [f"layer.{i}.w" for i in range(8)]
    source = PrefetchingSource(checkpoint, bucket_bytes=KB)
    try:
        source.start(order)
        last = source.load_tensors(["layer.7.w"])["layer.7.w"]  # the thread is blocked on layer.2: no deadlock
        again = [source.load_tensors([n])[n] for n in order]
        twice = source.load_tensors(["layer.0.w"])["layer.0.w"]
    finally:
        source.close()
    assert torch.equal(last, reference["layer.7.w"]) and torch.equal(twice, reference["layer.0.w"])
    assert all(torch.equal(t, reference[n]) for n, t in zip(order, again, strict=True))


def test_close_stops_a_read_ahead_nobody_consumes(checkpoint):
    from megatron_sao.checkpointing.hf_reader import PrefetchingSource

    source = PrefetchingSource(checkpoint, bucket_bytes=KB)
    source.start([f"layer.{i}.w" for i in range(8)])
    _wait_until_idle(source)
    source.close()
    assert source._thread is not None and not source._thread.is_alive()


def test_byte_budget_holds_at_most_its_capacity_and_serves_larger_requests_alone():
    from megatron_sao.checkpointing.io_bucket import ByteBudget

    budget = ByteBudget(100)
    held, peak, lock = [0], [0], threading.Lock()

    def hold(nbytes: int) -> None:
        with budget.hold(nbytes):
            with lock:
                held[0] += nbytes
                peak[0] = max(peak[0], held[0]) if nbytes <= 100 else peak[0]
                assert nbytes <= 100 or held[0] == nbytes, "a request above the capacity must run alone"
            time.sleep(0.01)
            with lock:
                held[0] -= nbytes

    threads = [threading.Thread(target=hold, args=(n,)) for n in [40, 40, 40, 250, 30, 60, 90, 10] * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0 < peak[0] <= 100 and budget.peak <= 100 and held[0] == 0


def test_checksum_shares_cover_every_file_once_and_balance_bytes():
    sizes = {f"__{r}_{i}.distcp": (r + 1) * 1000 + i for r in range(3) for i in range(2)} | {"metadata.json": 10}
    manifest = Manifest(role="actor", architecture="x", params_dtype="bfloat16", source="s", source_format="causal_lm",
                        layout={}, hf_tensors={}, files={n: {"bytes": b, "xxh3_128": ""} for n, b in sizes.items()})
    shares = [checksum_share(manifest, r, 3) for r in range(3)]
    assert sorted(n for share in shares for n in share) == sorted(sizes)
    loads = [sum(sizes[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert checksum_share(manifest, 0, 1) == sorted(sizes, key=lambda n: (-sizes[n], n))


def test_checksum_shares_follow_the_saving_rank_while_even():
    """A rank hashes the files it saved (it reads them in the same pass) up to an even share;
    a checkpoint saved by fewer ranks than load it is still split evenly."""
    from megatron_sao.checkpointing.fastio.distcp_items import saving_rank

    def manifest(sizes: dict[str, int]) -> Manifest:
        return Manifest(role="actor", architecture="x", params_dtype="bfloat16", source="s", source_format="causal_lm",
                        layout={}, hf_tensors={}, files={n: {"bytes": b, "xxh3_128": ""} for n, b in sizes.items()})

    saved_by_two = {"__0_0.distcp": 285, "__0_1.distcp": 284, "__1_0.distcp": 226, "__1_1.distcp": 225,
                    "metadata.json": 1}
    shares = [checksum_share(manifest(saved_by_two), r, 2, saved_by=saving_rank) for r in range(2)]
    assert shares == [["__0_0.distcp", "__0_1.distcp"], ["__1_0.distcp", "__1_1.distcp", "metadata.json"]]
    assert checksum_share(manifest(saved_by_two), 0, 2) == ["__0_0.distcp", "__1_1.distcp", "metadata.json"]  # by bytes
    saved_by_one = {"__0_0.distcp": 512, "__0_1.distcp": 511, "metadata.json": 1}
    shares = [checksum_share(manifest(saved_by_one), r, 2, saved_by=saving_rank) for r in range(2)]
    assert shares == [["__0_0.distcp"], ["__0_1.distcp", "metadata.json"]]
    assert saving_rank("__12_3.distcp") == 12 and saving_rank(".metadata") is None


def test_hashing_file_hashes_what_it_writes(tmp_path):
    import xxhash

    stream = HashingFile(tmp_path / "f")
    stream.write(b"abc" * 1000)
    stream.kick()
    stream.write(memoryview(b"xyz" * 7))
    size, digest = stream.finish()
    data = (tmp_path / "f").read_bytes()
    assert size == len(data) == 3021 and digest == xxhash.xxh3_128(data).hexdigest()


@pytest.mark.parametrize("fastio", [False, True], ids=["standard", "fastio"])
def test_a_file_cut_short_after_its_check_is_named_with_the_tensor(checkpoint, fastio):
    from megatron_sao.checkpointing.hf_reader import PrefetchingSource

    path = checkpoint.path / "model.safetensors"
    info = checkpoint.tensors["big"]
    with open(path, "r+b") as f:
        f.truncate(info.offset + info.nbytes // 2)
    source = PrefetchingSource(checkpoint, bucket_bytes=KB, fastio=fastio)
    try:
        with pytest.raises(ValueError, match=r"model\.safetensors: truncated while reading 'big' \(the file changed"):
            source.load_tensors(["big"])
    finally:
        source.close()
