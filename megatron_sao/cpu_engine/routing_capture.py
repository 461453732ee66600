"""Routed experts in the CPU engine: what SGLang's `--enable-return-routed-experts` records.

SGLang (0.5.23) captures, in every forward, the top-k expert ids each MoE layer chose for every
token it computed (`srt/layers/moe/topk.py::capture_routed_experts_if_allowed`), keeps them per
KV slot, and answers a request that set `return_routed_experts` with the routing of token
positions `[routed_experts_start_len, seqlen - 1)` as base64 int32 `[rows, num_hidden_layers, k]`
(`rollout/routing.py` has the encoding). The CPU engine does the same:

- `RoutingCapture` hooks the experts module of every MoE layer of the HF model (transformers
  5.12 calls it as `experts(hidden_states, top_k_index, top_k_weights)` in every MoE family the
  project runs) and records `top_k_index` for the forward in flight, `[B, S, num_layers, k]`
  (dense layers' entries stay 0, as in SGLang's buffer);
- `RoutingRecord` is one request's per-position routing: a position is recorded by the forward
  that first computes it (the prefill for the prompt, the decode step that feeds each sampled
  token) and kept afterwards, so a request continued across a weight update keeps each token's
  routing from the weights that computed it; a retracted request re-prefilled later records only
  positions it did not have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


class RoutingCapture:
    """Forward pre-hooks on every MoE layer's experts module of an HF causal LM."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = model.model.layers
        self.num_layers = len(layers)
        self.topk = int(model.config.num_experts_per_tok)
        self.moe_layers: list[int] = []
        self._buffer: torch.Tensor | None = None  # [B * S, num_layers, k] of the forward in flight
        self._handles = []
        for index, layer in enumerate(layers):
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is None:
                continue
            self.moe_layers.append(index)
            self._handles.append(experts.register_forward_pre_hook(self._hook(index), with_kwargs=True))
        if not self.moe_layers:
            raise ValueError("--enable-return-routed-experts: the model has no MoE layer (no mlp.experts module)")

    def _hook(self, layer: int):
        def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self._buffer is None:
                return
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            self._buffer[:, layer, :] = top_k_index.reshape(self._buffer.shape[0], self.topk)

        return record

    @contextlib.contextmanager
    def recording(self, batch: int, seq: int) -> Iterator[torch.Tensor]:
        """Record the forward run inside this block; yields its `[B, S, num_layers, k]` int32
        routing (filled when the block ends). HF flattens `[B, S]` batch-major for the experts."""
        self._buffer = torch.zeros((batch * seq, self.num_layers, self.topk), dtype=torch.int32)
        try:
            yield self._buffer.view(batch, seq, self.num_layers, self.topk)
        finally:
            self._buffer = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class RoutingRecord:
    """One request's routing by token position: `[positions, num_layers, k]` int32, grown as
    positions are computed."""

    def __init__(self, num_layers: int, topk: int) -> None:
        self._rows = np.zeros((0, num_layers, topk), dtype=np.int32)
        self.num_positions = 0
        """Positions 0..num_positions-1 are recorded."""

    def record(self, start: int, rows_slk: np.ndarray) -> None:
        """Routing of positions `[start, start + s)`; positions already recorded keep theirs."""
        end = start + rows_slk.shape[0]
        if end <= self.num_positions:
            return
        if start > self.num_positions:
            raise AssertionError(f"routing of positions from {start} recorded before position {self.num_positions}")
        if end > self._rows.shape[0]:
            grown = np.zeros((max(end, 2 * self._rows.shape[0] + 16), *self._rows.shape[1:]), dtype=np.int32)
            grown[:self.num_positions] = self._rows[:self.num_positions]
            self._rows = grown
        self._rows[self.num_positions:end] = rows_slk[self.num_positions - start:]
        self.num_positions = end

    def rows(self, start: int, end: int) -> np.ndarray | None:
        """Positions `[start, end)`, or None when some were never computed (a request aborted
        before its prefill)."""
        if end > self.num_positions:
            return None
        return self._rows[start:end]
