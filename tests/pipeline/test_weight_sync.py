"""Weight sync into real CPU engines: every mode lands every tensor, sets and checks the version,
and (end to end, on 2 gloo ranks, EP2) makes the engine sample with the trainer's log-probs after a
real actor optimizer step (fp32, <= 1e-4)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_sao.config.schema import WeightSyncConfig
from megatron_sao.pipeline.weight_sync import WeightSync, WeightSyncError, is_due, weights_checksum
from megatron_sao.platform import run_distributed
from megatron_sao.rollout.client import EngineClient, SamplingParams
from tests.pipeline.weight_sync_worker import sync_and_compare
from tests.rollout.engine_helpers import cpu_engine, tiny_checkpoint, tiny_checkpoint_other_seed

MODES = ["tensor", "disk", "distributed"]
PROMPT = list(range(10, 40))
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


class CheckpointExporter:
    """An exporter over an HF checkpoint on disk (what `HFWeightExporter` yields for a model that
    holds exactly those weights), for the single-process tests of the sync paths."""

    def __init__(self, hf_dir: Path) -> None:
        self.hf_dir = hf_dir
        self.tensors = load_file(str(hf_dir / "model.safetensors"))

    def buckets(self, bucket_bytes: int, cpu: bool = True, src_rank: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        for name, tensor in self.tensors.items():
            if bucket and size + tensor.nbytes > bucket_bytes:
                yield bucket
                bucket, size = {}, 0
            bucket[name], size = tensor, size + tensor.nbytes
        yield bucket


class NoVersionClient(EngineClient):
    """An engine that ignores version labels (as SGLang before `/update_weight_version`)."""

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> dict:
        return {"success": True}


@pytest.fixture(scope="module")
def outputs_of_b() -> list[int]:
    with cpu_engine(tiny_checkpoint_other_seed()) as server:
        return asyncio.run(EngineClient(server.url).generate(PROMPT, GREEDY)).output_ids


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_loads_every_tensor_into_two_engines(mode, outputs_of_b, tmp_path):
    exporter = CheckpointExporter(tiny_checkpoint_other_seed())
    config = WeightSyncConfig(mode=mode, bucket_mb=0.05, checksum=True)
    with cpu_engine() as a, cpu_engine() as b:

        async def go():
            clients = [EngineClient(a.url), EngineClient(b.url)]
            sync = WeightSync(exporter, config, disk_dir=str(tmp_path / "sync"))
            before = await clients[0].generate(PROMPT, GREEDY)
            report = await sync.push(clients, 7)
            outs = [await c.generate(PROMPT, GREEDY) for c in clients]
            again = await sync.push(clients, 8)  # a second sync reuses the group / replaces the directory
            await sync.close_group(clients)
            return before, report, outs, again, [await c.get_weight_version() for c in clients]

        before, report, outs, again, versions = asyncio.run(go())
        engine_sums = [weights_checksum({n: s.engine.scheduler.weight_map.views[n] for n in exporter.tensors})
                       for s in (a, b)]
    assert before.output_ids != outputs_of_b
    assert [o.output_ids for o in outs] == [outputs_of_b] * 2 and {o.weight_version for o in outs} == {"7"}
    assert versions == ["8", "8"]
    assert report.num_tensors == len(exporter.tensors) and report.num_buckets > 3
    assert report.num_bytes == sum(t.nbytes for t in exporter.tensors.values())
    assert report.checksum == weights_checksum(exporter.tensors) == engine_sums[0] == engine_sums[1]
    if mode == "disk":
        assert again.path.endswith("v8") and sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v8"]


def test_an_engine_left_on_the_old_version_is_named():
    exporter = CheckpointExporter(tiny_checkpoint_other_seed())
    with cpu_engine() as good, cpu_engine() as stale:
        clients = [EngineClient(good.url), NoVersionClient(stale.url)]
        with pytest.raises(WeightSyncError) as info:
            asyncio.run(WeightSync(exporter, WeightSyncConfig(mode="tensor")).push(clients, 3))
    assert stale.url in str(info.value) and good.url not in str(info.value) and "'0'" in str(info.value)


def test_a_refused_bucket_names_the_engine_and_the_call():
    exporter = CheckpointExporter(tiny_checkpoint())
    exporter.tensors["model.layers.0.not_a_weight"] = torch.zeros(2)
    with cpu_engine() as server, pytest.raises(WeightSyncError) as info:
        asyncio.run(WeightSync(exporter, WeightSyncConfig(mode="tensor", bucket_mb=1000)).push(
            [EngineClient(server.url)], 1))
    assert server.url in str(info.value) and "update_weights_from_tensor" in str(info.value)
    assert "unknown" in str(info.value)


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("mode", "nfs", "mode"), ("bucket_mb", 0, "bucket_mb"), ("every_n_steps", 0, "every_n_steps")])
def test_config_errors_name_the_field(field, value, needle):
    settings = {"mode": "tensor", field: value}
    with pytest.raises(ValueError, match=f"rollout.weight_sync.{needle}"):
        WeightSync(None, WeightSyncConfig(**settings))
    with pytest.raises(ValueError, match="disk_dir"):
        WeightSync(None, WeightSyncConfig(mode="disk"))
    with pytest.raises(ValueError, match="auto is resolved"):
        WeightSync(None, WeightSyncConfig())  # the schema's default mode: the caller resolves it
    assert [is_due(WeightSyncConfig(every_n_steps=2), v) for v in range(5)] == [False, False, True, False, True]


@pytest.fixture(scope="module")
def two_rank_sync(tmp_path_factory):
    work = tmp_path_factory.mktemp("weight_sync_e2e")
    return run_distributed(sync_and_compare, 2, str(tiny_checkpoint()), ["parallelism.expert=2"], MODES,
                           str(work))[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
def test_after_a_real_actor_step_the_engine_samples_with_the_trainers_logprobs(two_rank_sync, mode):
    result = two_rank_sync[mode]
    assert result["version"] == MODES.index(mode) + 1  # one applied actor update per step
    assert result["engine_version"] == result["answer_version"] == str(result["version"])
    assert result["changed_output"]  # the new weights matter to the engine
    engine, trainer = torch.tensor(result["engine_logprobs"]), torch.tensor(result["trainer_logprobs"])
    torch.testing.assert_close(engine, trainer, rtol=0, atol=1e-4)
    report = result["report"]
    assert report.num_tensors == 45 and report.num_buckets > 1
    assert report.checksum == result["engine_checksum"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_single_rank_trainer_syncs_every_mode(tmp_path):
    results = run_distributed(sync_and_compare, 1, str(tiny_checkpoint()), [], MODES, str(tmp_path))[0]
    for mode in MODES:
        assert results[mode]["engine_version"] == str(results[mode]["version"])
        torch.testing.assert_close(torch.tensor(results[mode]["engine_logprobs"]),
                                   torch.tensor(results[mode]["trainer_logprobs"]), rtol=0, atol=1e-4)
        assert results[mode]["report"].checksum == results[mode]["engine_checksum"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_sglang_engine_takes_each_mode(mode, tmp_path):
    """GPU only: the same pushes into a real SGLang server (CUDA-IPC payload, NCCL group, disk)."""
    pytest.importorskip("sglang", reason="the GPU test needs sglang (requirements-gpu.txt)")
    from megatron_sao.rollout.engine_supervisor import EngineConfig, EngineSupervisor

    class CudaExporter(CheckpointExporter):
        def buckets(self, bucket_bytes: int, cpu: bool = True, src_rank: int = 0):
            for bucket in super().buckets(bucket_bytes):
                yield bucket if cpu else {n: t.cuda() for n, t in bucket.items()}

    config = EngineConfig(backend="sglang", model_path=str(tiny_checkpoint()), mem_fraction_static=0.3,
                          log_dir=str(tmp_path),
                          extra_args=["--dtype", "float32", "--attention-backend", "triton", "--disable-cuda-graph"])
    sync_config = WeightSyncConfig(mode=mode, bucket_mb=0.05, checksum=True)
    with EngineSupervisor(config) as launcher:
        client = EngineClient(launcher.urls[0])

        async def go():
            sync = WeightSync(CudaExporter(tiny_checkpoint_other_seed()), sync_config, disk_dir=str(tmp_path / "sync"),
                              engine_format="sglang")
            report = await sync.push([client], 5)
            pushed = await client.generate(PROMPT, GREEDY)
            await client.update_weights_from_disk(str(tiny_checkpoint_other_seed()), weight_version="6")
            return report, pushed, await client.generate(PROMPT, GREEDY)

        report, pushed, loaded = asyncio.run(go())
    assert report.version == "5" and pushed.weight_version == "5"
    assert pushed.output_ids == loaded.output_ids
