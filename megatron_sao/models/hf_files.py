"""What a HuggingFace checkpoint directory holds, read from file headers only (no tensor data).

Conversion refuses to start on a checkpoint it cannot convert completely, and says why, naming
the file or tensor: a missing or truncated safetensors file, an index that lists a tensor its file
lacks, a tensor the config implies but no file holds, a tensor whose shape differs from what the
config implies. The config's tensor set is taken from transformers itself (the model built on the
meta device, with transformers' own save-time renaming), so it is the set `save_pretrained` would
write for that config.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype codes <-> torch dtypes
ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a safetensors file: where it is and what it is."""

    name: str
    file: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0
    """Absolute byte offset of the tensor's data in its file."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return ST_TO_TORCH[self.dtype]


@dataclass(slots=True)
class HFCheckpoint:
    """A HuggingFace checkpoint directory: its config.json and its safetensors tensors."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else f"<none; model_type={self.config.get('model_type')!r}>"

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})


def is_weight_file(name: str) -> bool:
    """Weights or a weight index: never copied alongside a converted checkpoint."""
    return name.endswith(_WEIGHT_SUFFIXES)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file; raises ValueError if the file is cut short or malformed."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, not even a header length)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise ValueError(f"{path}: truncated or not a safetensors file (header of {header_len} bytes "
                             f"announced, file has {size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from e
    header.pop("__metadata__", None)
    tensors, data_end = {}, 0
    for name, meta in header.items():
        begin, end = meta["data_offsets"]
        dtype = meta["dtype"]
        if dtype not in ST_TO_TORCH:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}, which conversion does not handle")
        tensors[name] = TensorInfo(name=name, file=path.name, dtype=dtype, shape=tuple(meta["shape"]),
                                   nbytes=end - begin, offset=8 + header_len + begin)
        data_end = max(data_end, end)
    if 8 + header_len + data_end > size:
        raise ValueError(f"{path}: truncated safetensors file: its header promises {8 + header_len + data_end} "
                         f"bytes, the file has {size} (a partial download or an interrupted copy?)")
    return tensors


def read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory")
    if not config_file.is_file():
        raise ValueError(f"{path}: no config.json (not a HuggingFace checkpoint directory)")
    return read_json_object(config_file)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; ValueError naming the file when it is not UTF-8, not JSON, or JSON
    of another kind (a list, a number)."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data


def inspect_hf_checkpoint(path: str | Path) -> HFCheckpoint:
    """Read config.json and every safetensors header of `path`; check the files are all there."""
    path = Path(path)
    config = read_config(path)
    checkpoint = HFCheckpoint(path=path, config=config)
    index_file = path / INDEX_FILE
    if index_file.is_file():
        weight_map = read_json_object(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            got = "missing" if weight_map is None else f"a {type(weight_map).__name__}"
            raise ValueError(f"{index_file}: field weight_map is {got}, expected an object mapping tensor names to "
                             "file names")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in sorted(by_file.items()):
            if not (path / file).is_file():
                raise ValueError(f"{path}: missing checkpoint file {file} (listed in {INDEX_FILE} for "
                                 f"{len(names)} tensors, e.g. {sorted(names)[0]!r})")
            held = read_safetensors_header(path / file)
            absent = sorted(set(names) - set(held))
            if absent:
                raise ValueError(f"{path / file}: partial checkpoint file: {len(absent)} tensors that {INDEX_FILE} "
                                 f"places in it are absent, e.g. {absent[0]!r}")
            for name in names:
                checkpoint.tensors[name] = held[name]
        return checkpoint
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {bins[0]}: save it as safetensors first)" if bins else ""
        raise ValueError(f"{path}: no model weights (no {INDEX_FILE} and no *.safetensors){hint}")
    for file in files:
        for name, info in read_safetensors_header(file).items():
            if name in checkpoint.tensors:
                raise ValueError(f"{path}: tensor {name!r} is in both {checkpoint.tensors[name].file} and {file.name}")
            checkpoint.tensors[name] = info
    return checkpoint


@dataclass(frozen=True, slots=True)
class ExpectedTensors:
    """The tensors (name -> shape) a causal-LM config implies, and the patterns of tensors that
    transformers itself leaves unloaded for it (e.g. DeepSeek-V3's multi-token-prediction layer)."""

    shapes: dict[str, tuple[int, ...]]
    ignored_patterns: tuple[str, ...]

    def is_ignored(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.ignored_patterns)


def expected_hf_tensors(config_dir: str | Path) -> ExpectedTensors:
    """Build the config's causal LM on the meta device and list what `save_pretrained` would write."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    config = transformers.AutoConfig.from_pretrained(str(config_dir))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = revert_weight_conversion(model, model.state_dict())
    ignored = tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    return ExpectedTensors(shapes={k: tuple(v.shape) for k, v in state.items()}, ignored_patterns=ignored)


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_weights_match_config(checkpoint: HFCheckpoint, expected: dict[str, tuple[int, ...]],
                               ignored: ExpectedTensors | None = None) -> list[str]:
    """Raise ValueError on missing tensors, shape mismatches or unexplained extra tensors.

    Returns the names of extra tensors transformers itself ignores for this architecture (they are
    carried through conversion unchanged).
    """
    where = checkpoint.path
    for name, shape in sorted(expected.items()):
        info = checkpoint.tensors.get(name)
        if info is not None and info.shape != shape:
            raise ValueError(f"{where}: config/weights mismatch for tensor {name!r}: config.json implies shape "
                             f"{list(shape)}, {info.file} holds {list(info.shape)}")
    missing = sorted(set(expected) - set(checkpoint.tensors))
    if missing:
        raise ValueError(f"{where}: missing or partial checkpoint files: {len(missing)} tensors that config.json "
                         f"implies are in no file: {_listing(missing)}")
    extra = sorted(set(checkpoint.tensors) - set(expected))
    carried = [n for n in extra if ignored is not None and ignored.is_ignored(n)]
    unexplained = sorted(set(extra) - set(carried))
    if unexplained:
        raise ValueError(f"{where}: config/weights mismatch: {len(unexplained)} tensors in the files are not part "
                         f"of the model config.json describes: {_listing(unexplained)}")
    return carried
