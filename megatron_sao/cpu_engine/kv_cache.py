"""A KV cache for continuous batching of a HuggingFace model on CPU.

transformers' `DynamicCache` concatenates on every step (an O(length) copy per layer per token)
and gives every row the same length. Here every layer keeps key/value buffers with spare capacity
(written in place), all rows share one column axis, and a row that is shorter than the longest is
left-padded: its padding columns are masked out by `attention_mask` and its RoPE positions come
from `position_ids`, exactly as in HF's own left-padded batch generation. Rows can be removed
(`select_rows`), and batches of different lengths merged (`merge`), which is what lets requests
join and leave the running batch between decode steps.

Shape legend: B rows, H key/value heads, L cached columns (`length`), C capacity >= L, D head dim.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def _grown(capacity: int, needed: int) -> int:
    return max(needed, capacity + capacity // 2 + 16)


class _GrowableLayer(CacheLayerMixin):
    """One layer's keys/values in [B, H, C, D] buffers; `keys`/`values` are [B, H, L, D] views."""

    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.k_buf = key_states.new_zeros((B, H, 0, D))
        self.v_buf = value_states.new_zeros((B, H, 0, value_states.shape[-1]))
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        assert self.k_buf is not None and self.v_buf is not None
        capacity = self.k_buf.shape[2]
        if needed <= capacity:
            return
        new_capacity = _grown(capacity, needed)
        for name in ("k_buf", "v_buf"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], new_capacity, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def _refresh_views(self) -> None:
        assert self.k_buf is not None and self.v_buf is not None
        self.keys = self.k_buf[:, :, : self.length]
        self.values = self.v_buf[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.k_buf is not None and self.v_buf is not None
        q = key_states.shape[2]
        self._reserve(self.length + q)
        self.k_buf[:, :, self.length : self.length + q] = key_states
        self.v_buf[:, :, self.length : self.length + q] = value_states
        self.length += q
        self._refresh_views()
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_cache_shape(self) -> int:
        return -1

    # ---- batch surgery (all rows of all layers change together; see RowKVCache) ----

    def select_rows(self, index: torch.Tensor) -> None:
        assert self.k_buf is not None and self.v_buf is not None
        self.k_buf = self.k_buf[index]
        self.v_buf = self.v_buf[index]
        self._refresh_views()

    def left_pad(self, num_columns: int) -> None:
        assert self.k_buf is not None and self.v_buf is not None
        for name in ("k_buf", "v_buf"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], self.length + num_columns, old.shape[3]))
            new[:, :, num_columns:] = old[:, :, : self.length]
            setattr(self, name, new)
        self.length += num_columns
        self._refresh_views()

    def drop_left(self, num_columns: int) -> None:
        assert self.k_buf is not None and self.v_buf is not None
        self.k_buf = self.k_buf[:, :, num_columns : self.length].clone()
        self.v_buf = self.v_buf[:, :, num_columns : self.length].clone()
        self.length -= num_columns
        self._refresh_views()

    def append_rows(self, other: _GrowableLayer) -> None:
        assert self.k_buf is not None and self.v_buf is not None
        assert other.k_buf is not None and other.v_buf is not None and other.length == self.length
        self.k_buf = torch.cat([self.k_buf[:, :, : self.length], other.k_buf[:, :, : other.length]], dim=0)
        self.v_buf = torch.cat([self.v_buf[:, :, : self.length], other.v_buf[:, :, : other.length]], dim=0)
        self._refresh_views()


class RowKVCache(Cache):
    """The running batch's cache: per-layer KV plus the [B, L] attention mask of cached columns."""

    def __init__(self, num_layers: int, batch_size: int) -> None:
        super().__init__(layers=[_GrowableLayer() for _ in range(num_layers)])
        self._mask = torch.zeros((batch_size, 0), dtype=torch.long)
        self.batch_size = batch_size

    @property
    def length(self) -> int:
        return self._mask.shape[1]

    def mask_with_new_columns(self, new_columns: torch.Tensor) -> torch.Tensor:
        """The attention mask for a forward that appends `new_columns` [B, q] (1 = real token) and
        records it; call once per forward, before the forward."""
        self._mask = torch.cat([self._mask, new_columns.to(torch.long)], dim=1)
        return self._mask

    def _layers(self) -> list[_GrowableLayer]:
        return self.layers  # type: ignore[return-value]

    def select_rows(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long)
        for layer in self._layers():
            layer.select_rows(index)
        self._mask = self._mask[index]
        self.batch_size = len(rows)

    def left_pad(self, num_columns: int) -> None:
        if num_columns <= 0:
            return
        for layer in self._layers():
            layer.left_pad(num_columns)
        pad = self._mask.new_zeros((self.batch_size, num_columns))
        self._mask = torch.cat([pad, self._mask], dim=1)

    def drop_unused_left_columns(self, min_columns: int = 32) -> int:
        """Drop leading columns that are padding in every row (after long rows finished); only
        when at least `min_columns` can go, so that the copy is amortised. Returns the count."""
        if self.batch_size == 0 or self.length == 0:
            return 0
        first_real = torch.where(self._mask.bool().any(dim=0))[0]
        droppable = int(first_real[0]) if first_real.numel() else self.length
        if droppable < min_columns:
            return 0
        for layer in self._layers():
            layer.drop_left(droppable)
        self._mask = self._mask[:, droppable:]
        return droppable

    def merge(self, other: RowKVCache) -> None:
        """Append `other`'s rows after this cache's rows, left-padding whichever is shorter."""
        if other.batch_size == 0:
            return
        if self.batch_size == 0:
            self.layers, self._mask, self.batch_size = other.layers, other._mask, other.batch_size
            return
        if self.length < other.length:
            self.left_pad(other.length - self.length)
        elif other.length < self.length:
            other.left_pad(self.length - other.length)
        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            mine.append_rows(theirs)
        self._mask = torch.cat([self._mask, other._mask], dim=0)
        self.batch_size += other.batch_size
