"""Pieces of the converter on their own: completeness guards, streaming writer, CLI, formats."""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from megatron_sao.checkpointing.families import family_of
from megatron_sao.checkpointing.hf_load import LoadSpec, _check_tasks
from megatron_sao.checkpointing.progress import Progress
from megatron_sao.checkpointing.safetensors_stream import StreamingSafetensorsWriter, TensorSpec, plan_shards
from megatron_sao.jobs.convert_parser import add_convert_parser
from megatron_sao.models import critic_format as cf
from megatron_sao.models.hf_files import HFCheckpoint, TensorInfo
from megatron_sao.utils.args import byte_size


def _checkpoint(**tensors: str) -> HFCheckpoint:
    infos = {n: TensorInfo(name=n, file="model.safetensors", dtype=d, shape=(2,), nbytes=8) for n, d in tensors.items()}
    return HFCheckpoint(path=Path("/ckpt"), config={}, tensors=infos)


def _task(global_name: str, hf_param, weight: torch.Tensor | None = None):
    return SimpleNamespace(global_param_name=global_name, mapping=SimpleNamespace(hf_param=hf_param),
                           param_weight=weight)


def test_guard_accepts_complete_tasks_and_drops_skipped_prefixes():
    spec = LoadSpec(checkpoint=_checkpoint(a="F32", b="F32", c="F32"), skip_megatron_prefixes=("output_layer.",),
                    handled_hf_tensors=frozenset({"c"}))
    tasks = [_task("x.weight", {"q": "a", "k": "b"}, torch.zeros(2)), _task("output_layer.weight", "c")]
    assert [t.global_param_name for t in _check_tasks(tasks, ["x.weight", "output_layer.weight"], spec)] == ["x.weight"]


def test_guard_refuses_a_megatron_parameter_without_mapping():
    spec = LoadSpec(checkpoint=_checkpoint(a="F32"))
    with pytest.raises(ValueError, match=re.escape("no mapping for Megatron parameter 'decoder.layers.3.mlp.experts."
                                                   "local_experts.7.linear_fc1.weight': it would keep random values")):
        _check_tasks([_task("x", "a"), None], ["x", "decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"],
                     spec)


def test_guard_refuses_a_missing_hf_tensor():
    spec = LoadSpec(checkpoint=_checkpoint(a="F32"))
    with pytest.raises(ValueError, match=r"missing tensor 'b' \(needed for Megatron parameter 'x'\)"):
        _check_tasks([_task("x", {"gate": "a", "up": "b"})], ["x"], spec)


def test_guard_refuses_to_drop_an_hf_tensor():
    spec = LoadSpec(checkpoint=_checkpoint(a="F32", mtp="F32"))
    with pytest.raises(ValueError, match=r"no Megatron parameter takes 1 HF tensors, e\.g\. \['mtp'\]: conversion "
                                         "would drop them"):
        _check_tasks([_task("x", "a")], ["x"], spec)


def test_guard_refuses_a_lossy_dtype():
    spec = LoadSpec(checkpoint=_checkpoint(bias="F32"))
    with pytest.raises(ValueError, match=re.escape("bias is torch.float32 but Megatron stores router.expert_bias as "
                                                   "torch.bfloat16: conversion would round it")):
        _check_tasks([_task("router.expert_bias", "bias", torch.zeros(2, dtype=torch.bfloat16))], ["x"], spec)


def test_streaming_writer_places_tensors_written_in_any_order(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.10.w": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        "model.layers.2.w": torch.randn(7, generator=generator),
        "model.layers.2.b": torch.randn(2, 2, generator=generator).to(torch.float16),
        "model.embed": torch.randn(4, 4, generator=generator, dtype=torch.float64),
    }
    specs = [TensorSpec(n, {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16",
                            torch.float64: "F64"}[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    writer = StreamingSafetensorsWriter(tmp_path, specs, max_shard_bytes=64)
    for name in reversed(list(tensors)):
        assert writer.missing() != []
        writer.write(name, tensors[name])
    assert writer.missing() == []
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    loaded = {}
    for file in set(index["weight_map"].values()):
        loaded.update(load_file(tmp_path / file))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_several_writers_share_the_planned_files(tmp_path):
    """One writer creates the files, another opens them: each writes its own tensors, together
    they make the checkpoint; only the creator writes the index; a foreign plan is refused."""
    tensors = {f"model.layers.{i}.w": torch.full((3, i + 1), float(i)) for i in range(5)}
    specs = [TensorSpec(n, "F32", tuple(t.shape)) for n, t in tensors.items()]
    with pytest.raises(ValueError, match="shared filesystem"):
        StreamingSafetensorsWriter(tmp_path, specs, max_shard_bytes=40, create=False)
    creator = StreamingSafetensorsWriter(tmp_path, specs, max_shard_bytes=40)
    other = StreamingSafetensorsWriter(tmp_path, specs, max_shard_bytes=40, create=False)
    for i, (name, tensor) in enumerate(tensors.items()):
        (creator if i % 2 else other).write(name, tensor)
    flags = [a + b for a, b in zip(creator.written_flags(), other.written_flags(), strict=True)]
    assert flags == [1] * len(tensors) and creator.missing() and other.missing()
    other.close(fsync=True)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    creator.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    loaded = {}
    for file in set(index["weight_map"].values()):
        loaded.update(load_file(tmp_path / file))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[n], t) for n, t in tensors.items())
    with pytest.raises(ValueError, match="another tensor list"):
        StreamingSafetensorsWriter(tmp_path, [*specs[:4], TensorSpec("model.layers.4.w", "F32", (3, 4))],
                                   max_shard_bytes=40, create=False)


def test_shards_follow_layer_order_and_respect_the_limit():
    specs = [TensorSpec(f"model.layers.{i}.w", "F32", (4,)) for i in (10, 2, 1)]
    shards = plan_shards(specs, max_shard_bytes=32)
    assert [[s.name for s in shard] for shard in shards] == [["model.layers.1.w", "model.layers.2.w"],
                                                              ["model.layers.10.w"]]


def test_progress_line_covers_every_phase_in_bytes():
    stream = io.StringIO()
    progress = Progress("hf -> mcore", total_bytes=4_000_000, stream=stream, min_interval_s=0.0)
    progress.start_phase("read", total_bytes=3_000_000)  # what will be read + the estimate of what is written
    progress.advance(1_000_000)
    first = stream.getvalue().strip().split("\r")[-1]
    assert "33.3%" in first and "read" in first and "1.00 MB/3.00 MB" in first
    progress.start_phase("write", total_bytes=4_000_000)  # the writer's plan: exact
    progress.advance(3_000_000)
    progress.close()
    last = stream.getvalue().strip().split("\r")[-1]
    assert "100.0%" in last and "write" in last and "4.00 MB/4.00 MB" in last and "/s" in last and "~0s left" in last


def test_cli_registers_three_commands_with_help(capsys):
    parser = argparse.ArgumentParser(prog="sao")
    add_convert_parser(parser.add_subparsers(dest="command"))
    for command, flags in (("hf-to-mcore", ["--hf", "--out", "--tp", "--pp", "--ep", "--etp", "--role"]),
                           ("mcore-to-hf", ["--mcore", "--out", "--hf-config", "--dtype", "--max-shard-size"]),
                           ("verify", ["--hf", "--mcore", "--tolerance"])):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["convert", command, "--help"])
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert all(flag in text for flag in flags), (command, text)
    args = parser.parse_args(["convert", "hf-to-mcore", "--hf", "a", "--out", "b", "--tp", "2", "--ep", "2"])
    assert callable(args.func) and (args.tp, args.pp, args.ep, args.etp) == (2, 1, 2, None)


@pytest.mark.parametrize("flag", [[], ["--fastio"]], ids=["default", "fastio"])
def test_the_fastio_switch_is_off_by_default_and_reaches_both_conversions(tmp_path, monkeypatch, flag):
    from megatron_sao.platform import run_collective as collective

    requests = []

    def capture(fn, nproc, request):
        requests.append(request)
        return 0, {"value_head": None, "passthrough": [], "summary": "ok"}

    monkeypatch.setattr(collective, "run_collective", capture)
    parser = argparse.ArgumentParser(prog="sao")
    add_convert_parser(parser.add_subparsers(dest="command"))
    for argv in (["hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m")],
                 ["mcore-to-hf", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "h")]):
        args = parser.parse_args(["convert", *argv, *flag])
        assert args.func(args) == 0
    assert [r.fastio for r in requests] == [bool(flag)] * 2


def test_sizes_parse_like_huggingface():
    assert byte_size("5GB") == 5 * 10**9 and byte_size("500MB") == 5 * 10**8 and byte_size("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size("five")


def test_critic_config_round_trips_to_the_causal_config():
    causal = {"architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64, "model_type": "glm4_moe"}
    critic = cf.critic_config(causal)
    assert critic["architectures"] == ["Glm4MoeForTokenClassification"] and critic["num_labels"] == 1
    assert cf.is_critic_config(critic) and not cf.is_critic_config(causal)
    assert cf.causal_config(critic) == causal
    assert family_of(critic, "x").architecture == "Glm4MoeForCausalLM"


def test_weight_files_and_indexes_are_never_copied_as_side_files():
    from megatron_sao.models.hf_files import is_weight_file

    assert all(is_weight_file(n) for n in ("model-00001-of-00002.safetensors", "model.safetensors.index.json",
                                           "pytorch_model.bin", "consolidated.pth"))
    assert not any(is_weight_file(n) for n in ("config.json", "tokenizer.json", "generation_config.json"))
