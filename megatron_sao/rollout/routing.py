"""Routed experts: which experts the rollout engine's router chose for every token (R3 replay).

In MoE RL the engine and the trainer route tokens independently, and small numerical
differences flip expert choices; the trainer can instead replay the engine's choices
(training/routing_replay.py). This module is the record side, free of Megatron:

- `RoutingSpec`: a model's routing layout, read from its HF `config.json`: the decoder layers
  (SGLang's layer axis), which of them are MoE layers, top-k and the number of experts;
- `RoutedExperts`: per token of a trajectory, per MoE layer, the top-k global expert indices,
  `[num_tokens, num_moe_layers, topk]` int16; a token the engine did not route (the last token
  of a trajectory is never fed to the engine) holds `NOT_ROUTED` in every entry;
- SGLang's wire encoding (sglang 0.5.23): with the server flag `--enable-return-routed-experts`
  and the request field `return_routed_experts: true`, `meta_info["routed_experts"]` is the
  base64 of a C-ordered int32 array `[seqlen - 1 - routed_experts_start_len, num_hidden_layers,
  num_experts_per_tok]` covering token positions `[routed_experts_start_len, seqlen - 1)`
  (`srt/managers/scheduler_components/batch_result_processor.py::_maybe_collect_routed_experts`,
  `srt/state_capturer/base.py::get_topk`, `srt/managers/detokenizer_manager.py`;
  `srt/state_capturer/routed_experts.py::extract_routed_experts_from_meta_info` is SGLang's own
  decoder). Prompt tokens are included (they are routed in the prefill); the indices are logical
  expert ids, captured before any expert-location remapping (`srt/layers/moe/topk.py`); dense
  layers' rows are never written (zeros).

Shape legend: n tokens, L MoE layers, k experts per token.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

NOT_ROUTED = -1
"""Every entry of a token the engine did not route (the trainer routes it itself)."""
MAX_EXPERTS = int(np.iinfo(np.int16).max)
"""Expert indices are stored as int16."""


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """A model's routing layout as the engine reports it."""

    num_layers: int
    """Decoder layers: the layer axis of SGLang's `routed_experts` (dense layers included)."""
    moe_layers: tuple[int, ...]
    """0-based indices of the MoE layers among them; the record keeps these, in this order."""
    topk: int
    num_experts: int

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def check(self, routed: RoutedExperts) -> None:
        """ValueError unless `routed` has this spec's layers, top-k and expert range."""
        if (routed.num_layers, routed.topk) != (self.num_moe_layers, self.topk):
            raise ValueError(f"routed_experts has {routed.num_layers} MoE layers x top-{routed.topk}, the model has "
                             f"{self.num_moe_layers} x top-{self.topk}")
        routed.check(self.num_experts)


def _first_int(config: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def moe_layer_indices(config: Mapping[str, Any]) -> list[int]:
    """The MoE layers of an HF config, as transformers 5.12 builds the families this project runs:
    Qwen3-MoE (`mlp_only_layers`, `decoder_sparse_step`: `modeling_qwen3_moe.Qwen3MoeDecoderLayer`)
    and DeepSeek-V3 / GLM-4.5 / GLM-5 (`first_k_dense_replace`, `moe_layer_freq`:
    `modeling_deepseek_v3.DeepseekV3DecoderLayer`). No experts: no MoE layer."""
    config = {**config, **(config.get("text_config") or {})}
    num_layers = _first_int(config, "num_hidden_layers") or 0
    if not _first_int(config, "num_experts", "n_routed_experts", "num_local_experts"):
        return []
    if "first_k_dense_replace" in config or "moe_layer_freq" in config:
        first_dense = int(config.get("first_k_dense_replace") or 0)
        freq = int(config.get("moe_layer_freq") or 1)
        return [i for i in range(num_layers) if i >= first_dense and i % freq == 0]
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


def routing_spec_from_hf_config(config: Mapping[str, Any]) -> RoutingSpec | None:
    """The routing layout of an HF `config.json` (as a dict); None for a dense model."""
    moe_layers = moe_layer_indices(config)
    if not moe_layers:
        return None
    text = {**config, **(config.get("text_config") or {})}
    num_experts = _first_int(text, "num_experts", "n_routed_experts", "num_local_experts")
    topk = _first_int(text, "num_experts_per_tok", "moe_topk")
    if num_experts is None or topk is None:
        raise ValueError("the model's config.json names MoE layers but not num_experts / num_experts_per_tok")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"{num_experts} experts do not fit the int16 routing record (at most {MAX_EXPERTS})")
    return RoutingSpec(num_layers=int(text["num_hidden_layers"]), moe_layers=tuple(moe_layers), topk=topk,
                       num_experts=num_experts)


class RoutedExperts:
    """Expert indices `[n, L, k]` (int16) of one trajectory's tokens; `NOT_ROUTED` rows for tokens
    the engine did not route. Compared by value."""

    __slots__ = ("indices_nlk",)

    def __init__(self, indices_nlk: np.ndarray) -> None:
        array = np.asarray(indices_nlk)
        if array.ndim != 3:
            raise ValueError(f"routed_experts must be [tokens, moe_layers, topk], got shape {array.shape}")
        if array.shape[1] < 1 or array.shape[2] < 1:
            raise ValueError(f"routed_experts needs >= 1 MoE layer and top-k >= 1, got shape {array.shape}")
        if array.size and (array.min() < NOT_ROUTED or array.max() > MAX_EXPERTS):
            raise ValueError(f"routed_experts entries must be expert indices in [0, {MAX_EXPERTS}] or "
                             f"{NOT_ROUTED}, got {int(array.min())}..{int(array.max())}")
        self.indices_nlk = np.ascontiguousarray(array, dtype=np.int16)

    @classmethod
    def empty(cls, num_tokens: int, num_layers: int, topk: int) -> RoutedExperts:
        return cls(np.full((num_tokens, num_layers, topk), NOT_ROUTED, dtype=np.int16))

    # ---- shape and content ------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return self.indices_nlk.shape[0]

    @property
    def num_layers(self) -> int:
        return self.indices_nlk.shape[1]

    @property
    def topk(self) -> int:
        return self.indices_nlk.shape[2]

    @property
    def nbytes(self) -> int:
        return int(self.indices_nlk.nbytes)

    def routed_mask(self) -> np.ndarray:
        """[n] bool: tokens the engine routed."""
        return (self.indices_nlk != NOT_ROUTED).all(axis=(1, 2))

    def num_leading_routed(self) -> int:
        """Tokens routed from position 0 on, before the first one that is not."""
        unrouted = np.flatnonzero(~self.routed_mask())
        return int(unrouted[0]) if unrouted.size else self.num_tokens

    def check(self, num_experts: int | None = None) -> None:
        """ValueError naming the first bad token: a token whose entries mix `NOT_ROUTED` with
        experts, an expert chosen twice for one token and layer, or (with `num_experts`) an
        index out of range."""
        routed = self.indices_nlk >= 0
        partial = routed.any(axis=(1, 2)) & ~routed.all(axis=(1, 2))
        if partial.any():
            t = int(np.flatnonzero(partial)[0])
            raise ValueError(f"routed_experts[{t}] mixes experts with {NOT_ROUTED} (not routed) entries")
        if num_experts is not None and (self.indices_nlk >= num_experts).any():
            t = int(np.flatnonzero((self.indices_nlk >= num_experts).any(axis=(1, 2)))[0])
            raise ValueError(f"routed_experts[{t}] has expert index {int(self.indices_nlk[t].max())} outside "
                             f"[0, {num_experts})")
        if self.topk > 1:
            ordered = np.sort(self.indices_nlk, axis=2)
            repeated = ((ordered[:, :, 1:] == ordered[:, :, :-1]) & (ordered[:, :, 1:] >= 0)).any(axis=(1, 2))
            if repeated.any():
                t = int(np.flatnonzero(repeated)[0])
                raise ValueError(f"routed_experts[{t}] chooses the same expert twice in one layer")

    # ---- building (the agent loop) ----------------------------------------------------------

    def resized(self, num_tokens: int) -> RoutedExperts:
        """This record cut or padded (with `NOT_ROUTED` rows) to `num_tokens` rows."""
        if num_tokens <= self.num_tokens:
            return RoutedExperts(self.indices_nlk[:num_tokens])
        pad = np.full((num_tokens - self.num_tokens, self.num_layers, self.topk), NOT_ROUTED, dtype=np.int16)
        return RoutedExperts(np.concatenate([self.indices_nlk, pad]))

    def with_rows(self, start: int, rows_mlk: np.ndarray) -> RoutedExperts:
        """A copy whose rows `[start, start + m)` are `rows_mlk` (grown as needed)."""
        rows = RoutedExperts(rows_mlk)  # validates range and rank
        if (rows.num_layers, rows.topk) != (self.num_layers, self.topk):
            raise ValueError(f"routing rows of {rows.num_layers} layers x top-{rows.topk} do not fit a record of "
                             f"{self.num_layers} x top-{self.topk}")
        out = self.resized(max(self.num_tokens, start + rows.num_tokens)).indices_nlk.copy()
        out[start:start + rows.num_tokens] = rows.indices_nlk
        return RoutedExperts(out)

    # ---- serialisation ----------------------------------------------------------------------

    def to_lists(self) -> list[list[list[int]] | None]:
        """JSON form: one entry per token, `[L][k]` indices or None (not routed)."""
        mask = self.routed_mask()
        rows = self.indices_nlk.tolist()
        return [row if routed else None for row, routed in zip(rows, mask, strict=True)]

    @classmethod
    def from_lists(cls, entries: Sequence[Sequence[Sequence[int]] | None]) -> RoutedExperts:
        """Parse the JSON form; every non-null entry must have the same `[L][k]` shape."""
        shape = next((np.shape(e) for e in entries if e is not None), None)
        if shape is None:
            raise ValueError("routed_experts has no routed token (use null for a trajectory without routing)")
        if len(shape) != 2:
            raise ValueError(f"routed_experts entries must be [moe_layers][topk] lists, got shape {shape}")
        out = np.full((len(entries), *shape), NOT_ROUTED, dtype=np.int64)
        for t, entry in enumerate(entries):
            if entry is None:
                continue
            row = np.asarray(entry)
            if row.shape != shape or row.dtype.kind not in "iu":
                raise ValueError(f"routed_experts[{t}] has shape {row.shape} ({row.dtype}), expected integer {shape} "
                                 "like the first routed token")
            if (row < 0).any():
                raise ValueError(f"routed_experts[{t}] has a negative expert index (use null for a token that "
                                 "was not routed)")
            out[t] = row
        return cls(out)

    def to_flat(self) -> np.ndarray:
        """Parquet form: the int16 entries in C order (`NOT_ROUTED` rows kept)."""
        return self.indices_nlk.reshape(-1)

    @classmethod
    def from_flat(cls, values: Sequence[int] | np.ndarray, num_layers: int, topk: int) -> RoutedExperts:
        flat = np.asarray(values)
        if num_layers < 1 or topk < 1 or flat.size % (num_layers * topk):
            raise ValueError(f"routed_experts has {flat.size} entries, not a whole number of tokens of "
                             f"{num_layers} layers x top-{topk}")
        return cls(flat.reshape(-1, num_layers, topk))

    def pack(self) -> dict[str, Any]:
        """Compact JSON form for checkpointed state (base64 of the int16 array, little-endian):
        2.7 characters per entry where the list form takes ~4 (and a line each, indented)."""
        return {"shape": list(self.indices_nlk.shape),
                "int16_b64": base64.b64encode(self.indices_nlk.astype("<i2").tobytes()).decode("ascii")}

    @classmethod
    def unpack(cls, packed: Mapping[str, Any]) -> RoutedExperts:
        shape = tuple(int(x) for x in packed["shape"])
        return cls(np.frombuffer(base64.b64decode(packed["int16_b64"]), dtype="<i2").reshape(shape))

    # ---- value semantics --------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutedExperts):
            return NotImplemented
        return self.indices_nlk.shape == other.indices_nlk.shape and bool(np.array_equal(self.indices_nlk,
                                                                                         other.indices_nlk))

    def __repr__(self) -> str:
        return (f"RoutedExperts({self.num_tokens} tokens x {self.num_layers} layers x top-{self.topk}, "
                f"{int(self.routed_mask().sum())} routed)")

    def __getstate__(self) -> np.ndarray:
        return self.indices_nlk

    def __setstate__(self, state: np.ndarray) -> None:
        self.indices_nlk = state


# ---- SGLang's wire encoding -------------------------------------------------------------------

def encode_sglang_routed_experts(indices_rlk: np.ndarray) -> str:
    """`meta_info["routed_experts"]` as SGLang sends it: base64 of C-ordered int32
    `[rows, num_hidden_layers, k]` (`detokenizer_manager._b64_encode_per_request`)."""
    return base64.b64encode(np.ascontiguousarray(indices_rlk, dtype="<i4").tobytes()).decode("ascii")


def decode_sglang_routed_experts(encoded: str, spec: RoutingSpec, num_rows: int) -> np.ndarray:
    """SGLang's `meta_info["routed_experts"]` -> `[num_rows, L, k]` int64 of the MoE layers.
    ValueError when the payload does not hold `num_rows` x the model's layers x top-k."""
    try:
        raw = base64.b64decode(encoded.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise ValueError(f"routed_experts is not base64: {e}") from e
    per_row = spec.num_layers * spec.topk * 4
    if len(raw) != num_rows * per_row:
        raise ValueError(f"routed_experts holds {len(raw)} bytes, expected {num_rows} positions x {spec.num_layers} "
                         f"layers x top-{spec.topk} x 4 bytes = {num_rows * per_row} (a different model, or an "
                         "engine that routed other positions)")
    full = np.frombuffer(raw, dtype="<i4").reshape(num_rows, spec.num_layers, spec.topk)
    moe = full[:, list(spec.moe_layers), :].astype(np.int64)
    if moe.size and (moe.min() < 0 or moe.max() >= spec.num_experts):
        raise ValueError(f"routed_experts has expert indices {int(moe.min())}..{int(moe.max())} outside "
                         f"[0, {spec.num_experts})")
    return moe
