"""Helpers of the conversion tests: tiny checkpoints with the awkward cases in them, exact compare."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_sao.models.hf_files import HFCheckpoint, read_safetensors_header
from megatron_sao.models.tiny_hf import build_tiny_hf_checkpoint


def all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(str(directory / "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = f.get_tensor(name)
    return tensors


def differences(a_dir: Path, b_dir: Path, ignore: frozenset[str] = frozenset()) -> list[str]:
    """Every way the tensors of two HF directories differ: names, dtypes, shapes, bytes."""
    a, b = all_tensors(a_dir), all_tensors(b_dir)
    out = [f"only in {a_dir.name}: {n}" for n in sorted(set(a) - set(b) - ignore)]
    out += [f"only in {b_dir.name}: {n}" for n in sorted(set(b) - set(a) - ignore)]
    for name in sorted((set(a) & set(b)) - ignore):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        elif not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            out.append(f"{name}: values differ (max abs {(x.double() - y.double()).abs().max().item():.3e})")
    return out


def rewrite_tensors(directory: Path, change) -> None:
    """Apply `change(dict of tensors) -> dict` to a single-file checkpoint in place."""
    path = directory / "model.safetensors"
    tensors = change(load_file(path))
    save_file(tensors, path, metadata={"format": "pt"})


def tiny_checkpoint(root: Path, family: str, dtype: torch.dtype, mtp_passthrough: bool = False) -> Path:
    """A tiny `family` checkpoint in `dtype` whose fp32 router biases are random (so a bf16 round
    trip through them would show) and, optionally, with an extra MTP-layer tensor that transformers
    ignores for the architecture (DeepSeek-V3: model.layers.61.*), to be carried through."""
    path = build_tiny_hf_checkpoint(root / f"{family}_{str(dtype).removeprefix('torch.')}", family=family,
                                    dtype=dtype)
    generator = torch.Generator().manual_seed(5)

    def change(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name in tensors:
            if name.endswith("e_score_correction_bias"):
                tensors[name] = torch.randn(tensors[name].shape, generator=generator, dtype=torch.float32)
        if mtp_passthrough:
            tensors["model.layers.61.eh_proj.weight"] = torch.randn(64, 128, generator=generator).to(dtype)
        return tensors

    rewrite_tensors(path, change)
    return path


def small_hf_checkpoint(directory: Path) -> HFCheckpoint:
    """A one-file safetensors checkpoint of awkward tensors (bf16 and fp32 at unaligned offsets, one
    larger than the test buckets, int64, empty) and its parsed header: for the HF reader tests."""
    generator = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.w": torch.randn(16, 16, generator=generator).to(torch.bfloat16) for i in range(8)}  # 512 B
    tensors["big"] = torch.randn(64, 64, generator=generator)  # 16 KB, larger than any bucket the tests use
    tensors["ids"] = torch.arange(5, dtype=torch.int64)
    tensors["empty"] = torch.zeros(0, 3)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return HFCheckpoint(path=directory, config={}, tensors=read_safetensors_header(directory / "model.safetensors"))


def safetensors_reference(checkpoint: HFCheckpoint) -> dict[str, torch.Tensor]:
    """Every tensor of a one-file checkpoint, read by safetensors itself."""
    with safe_open(str(checkpoint.path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a mapping


def split_into_shards(directory: Path, num_shards: int = 2) -> None:
    """Re-save a single-file checkpoint as `num_shards` files plus model.safetensors.index.json."""
    tensors = load_file(directory / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def ok(result: dict) -> dict:
    """A job step's result, or a test failure carrying the rank's traceback."""
    if "error" in result:
        pytest.fail(result["error"], pytrace=False)
    return result


def refuse_direct_io(monkeypatch, call: str = "preadv") -> list[int]:
    """Every `os.<call>` (`preadv` or `pwrite`) on an O_DIRECT descriptor fails with EINVAL, as on
    filesystems that accept the open but not the I/O; returns the refusals."""
    import errno
    import fcntl
    import os

    from megatron_sao.checkpointing.fastio import direct_io

    refused: list[int] = []
    real = getattr(os, call)

    def refusing(fd: int, data, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "direct I/O refused")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, call, refusing)
    return refused
