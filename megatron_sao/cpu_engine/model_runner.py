"""The model side of the CPU engine: load an HF causal LM, run batched prefill and decode steps.

Prefill left-pads a group of new sequences to a common length and returns the logits of each
row's last position; decode feeds one pending token per row. Both use `RowKVCache`, with
`position_ids` counted from each row's first real token, so a row's numbers do not depend on the
padding its batch-mates impose (up to floating-point reassociation). With `capture_routing`
(`--enable-return-routed-experts`) every forward also leaves the experts each MoE layer chose for
every column in `last_routing` (routing_capture.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_sao.cpu_engine.kv_cache import RowKVCache
from megatron_sao.cpu_engine.routing_capture import RoutingCapture

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


class ModelRunner:
    """Owns the model and tokenizer. Not thread-safe: only the scheduler thread calls it."""

    def __init__(self, model_path: str | Path, dtype: torch.dtype = torch.float32,
                 capture_routing: bool = False) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.model_path = str(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        self.model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.config = self.model.config
        self.num_layers = int(self.config.num_hidden_layers)
        self.vocab_size = int(self.config.vocab_size)
        self.context_length = int(getattr(self.config, "max_position_embeddings", 1 << 20))
        eos: set[int] = set()
        sources: list[object] = [self.config.eos_token_id, self.tokenizer.eos_token_id]
        with contextlib.suppress(OSError):  # no generation_config.json: config's EOS only
            sources.append(GenerationConfig.from_pretrained(self.model_path).eos_token_id)
        for ids in sources:
            if ids is None:
                continue
            eos.update([int(ids)] if isinstance(ids, int) else (int(i) for i in ids))  # type: ignore[union-attr]
        self.eos_token_ids = frozenset(eos)
        # Longest vocabulary entry in characters (byte-level BPE entries have one character per byte,
        # so this bounds the characters any one token can stand for): sizes the text-prompt limit.
        self.max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=16)
        self.routing = RoutingCapture(self.model) if capture_routing else None
        self.last_routing: torch.Tensor | None = None
        """`[B, S, num_layers, k]` int32 experts of the last forward's columns (with capture_routing)."""

    def _forward(self, batch: int, seq: int, **inputs):
        """The model's forward, recording its routing when the engine captures it."""
        if self.routing is None:
            return self.model(**inputs)
        with self.routing.recording(batch, seq) as routing_bslk:
            out = self.model(**inputs)
        self.last_routing = routing_bslk
        return out

    def prefill(self, sequences: Sequence[list[int]]) -> tuple[RowKVCache, torch.Tensor]:
        """Run `sequences` (token lists, >= 1 token each) through the model.

        Returns the new cache (all tokens cached, left-padded to the longest) and the float32
        logits [b, V] of each sequence's last token.
        """
        cache, logits = self.prefill_last(sequences, 1)
        return cache, logits[:, -1, :]

    @torch.inference_mode()
    def prefill_last(self, sequences: Sequence[list[int]], keep_last: int) -> tuple[RowKVCache, torch.Tensor]:
        """`prefill`, keeping the float32 logits [b, keep_last, V] of the last `keep_last` columns
        (prompt log-probs need them). Rows are left-padded: a row of n tokens has real logits in its
        last min(n, keep_last) columns."""
        lengths = [len(s) for s in sequences]
        assert min(lengths) >= 1
        b, P = len(sequences), max(lengths)
        input_ids = torch.zeros((b, P), dtype=torch.long)
        new_columns = torch.zeros((b, P), dtype=torch.long)
        for i, seq in enumerate(sequences):
            input_ids[i, P - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            new_columns[i, P - len(seq) :] = 1
        position_ids = (new_columns.cumsum(dim=1) - 1).clamp(min=0)
        cache = RowKVCache(self.num_layers, b)
        attention_mask = cache.mask_with_new_columns(new_columns)
        out = self._forward(
            b, P,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=keep_last,
        )
        return cache, out.logits[:, -keep_last:, :].float()

    @torch.inference_mode()
    def decode(self, cache: RowKVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step: feed `tokens` [B] at `positions` [B]; returns float32 logits [B, V]."""
        attention_mask = cache.mask_with_new_columns(torch.ones((tokens.shape[0], 1), dtype=torch.long))
        out = self._forward(
            tokens.shape[0], 1,
            input_ids=tokens.unsqueeze(1),
            attention_mask=attention_mask,
            position_ids=positions.unsqueeze(1),
            past_key_values=cache,
            use_cache=True,
        )
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def full_logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        """log_softmax of the logits at every position of one unpadded sequence, float32 [n, V]
        (a reference for tests: no cache, no padding)."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        logits = self.model(input_ids=ids, use_cache=False).logits[0].float()
        return torch.log_softmax(logits, dim=-1)
