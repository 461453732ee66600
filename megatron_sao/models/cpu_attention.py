"""Causal core attention for the CPU layer spec: memory linear in sequence length, context parallel.

Megatron-Core's local `DotProductAttention` materialises `[b, heads, s, s]` scores (and a
`[s, s]` causal mask) and refuses context parallelism (`dot_product_attention.py`: "Context
parallelism is only supported by TEDotProductAttention"). `CausalAttention` replaces it in
`cpu_spec.cpu_block_spec`, for standard (GQA) and multi-latent attention alike:

- causal by position, from the layer's mask type (every self-attention of the GPT specs is
  `AttnMaskType.causal`): the model is called with `attention_mask=None`, no mask tensor exists;
- the arithmetic is PyTorch's CPU flash-attention kernel
  (`aten::_scaled_dot_product_flash_attention_for_cpu`, the kernel `F.scaled_dot_product_attention`
  dispatches to on CPU): blockwise online softmax, so memory is linear in the sequence length; it
  returns the row log-sum-exp, which lets partial results be merged exactly;
- under context parallelism each rank holds two chunks of every sequence (Megatron's
  load-balanced layout: chunks r and 2 CP - 1 - r of 2 CP, `megatron.core.utils.
  get_batch_on_this_cp_rank`). Keys and values are all-gathered over the CP group (Transformer
  Engine's `cp_comm_type="all_gather"`); a local query chunk attends causally to its own chunk and
  fully to every earlier chunk, the two partial results merged by their log-sum-exps. The backward
  runs the flash backward kernel per block with the merged output and log-sum-exp (the exact
  gradient of the merged softmax, as ring/flash CP implementations do), and reduce-scatters the
  key/value gradients back to the ranks that own them. Only the local keys and values are saved
  for the backward (gathered again there), so per-rank memory stays ~1/CP of the sequence.

On GPU the Transformer Engine spec's `TEDotProductAttention` does this with the configured
`cp_comm_type` (docs/training.md has the mapping); this module is the CPU stand-in with the same
semantics: the same layout, the same causal-by-global-position result.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _size(group: Any) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def _rank(group: Any) -> int:
    return 0 if group is None else torch.distributed.get_rank(group)


def _chunk_order(cp: int) -> list[int]:
    """Global chunk index of each chunk in rank order: rank j holds chunks j and 2cp - 1 - j."""
    return [c for j in range(cp) for c in (j, 2 * cp - 1 - j)]


def _gather_sequence(local_bhsd: torch.Tensor, group: Any) -> torch.Tensor:
    """[b, h, 2L, d] of every CP rank -> [b, h, 2 cp L, d] in global sequence order."""
    cp = _size(group)
    if cp == 1:
        return local_bhsd
    b, h, s, d = local_bhsd.shape
    chunk = s // 2
    gathered = torch.empty((cp * s, b, h, d), dtype=local_bhsd.dtype, device=local_bhsd.device)
    torch.distributed.all_gather_into_tensor(gathered, local_bhsd.permute(2, 0, 1, 3).contiguous(), group=group)
    by_chunk = gathered.view(2 * cp, chunk, b, h, d)
    order = torch.tensor(_chunk_order(cp), device=local_bhsd.device)
    global_chunks = torch.empty_like(by_chunk).index_copy_(0, order, by_chunk)
    return global_chunks.view(2 * cp * chunk, b, h, d).permute(1, 2, 0, 3)


def _reduce_scatter_sequence(full_bhsd: torch.Tensor, group: Any) -> torch.Tensor:
    """Inverse of `_gather_sequence` for gradients: sum over ranks, keep this rank's chunks."""
    cp = _size(group)
    if cp == 1:
        return full_bhsd
    b, h, s, d = full_bhsd.shape
    chunk = s // (2 * cp)
    order = torch.tensor(_chunk_order(cp), device=full_bhsd.device)
    by_chunk = full_bhsd.permute(2, 0, 1, 3).reshape(2 * cp, chunk, b, h, d)
    rank_order = by_chunk.index_select(0, order).reshape(2 * cp * chunk, b, h, d)
    out = torch.empty((2 * chunk, b, h, d), dtype=full_bhsd.dtype, device=full_bhsd.device)
    torch.distributed.reduce_scatter_tensor(out, rank_order.contiguous(), group=group)
    return out.permute(1, 2, 0, 3)


def _query_blocks(local_len: int, group: Any) -> list[tuple[slice, int]]:
    """Per local query chunk: its slice of the local sequence and its global start position."""
    cp = _size(group)
    if cp == 1:
        return [(slice(0, local_len), 0)]
    chunk, rank = local_len // 2, _rank(group)
    return [(slice(0, chunk), rank * chunk), (slice(chunk, 2 * chunk), (2 * cp - 1 - rank) * chunk)]


class _CausalFlashAttention(torch.autograd.Function):
    """Causal attention of the local queries over the whole (CP-gathered) sequence; see the module
    docstring. Tensors are [b, heads, s, d]; keys/values may have fewer heads (GQA)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: Any) -> torch.Tensor:
        k_all, v_all = _gather_sequence(k, group), _gather_sequence(v, group)
        outs, lses = [], []
        for rows, start in _query_blocks(q.shape[2], group):
            q_c = q[:, :, rows]
            out, lse = _flash(q_c, k[:, :, rows], v[:, :, rows], 0.0, True, scale=scale)
            if start > 0:  # every earlier position of the sequence, unmasked
                past_out, past_lse = _flash(q_c, k_all[:, :, :start], v_all[:, :, :start], 0.0, False, scale=scale)
                merged = torch.logaddexp(lse, past_lse)
                wide = torch.promote_types(q.dtype, torch.float32)  # bf16 inputs merge in fp32
                out = ((lse - merged).exp().unsqueeze(-1) * out.to(wide)
                       + (past_lse - merged).exp().unsqueeze(-1) * past_out.to(wide)).to(q.dtype)
                lse = merged
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        grad_out = grad_out.contiguous()
        k_all, v_all = _gather_sequence(k, group), _gather_sequence(v, group)
        dq = torch.zeros_like(q)
        dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
        for rows, start in _query_blocks(q.shape[2], group):
            q_c, go, o, l_c = q[:, :, rows], grad_out[:, :, rows], out[:, :, rows], lse[:, :, rows]
            end = start + q_c.shape[2]
            g_q, g_k, g_v = _flash_backward(go, q_c, k_all[:, :, start:end], v_all[:, :, start:end], o, l_c, 0.0, True,
                                            scale=scale)
            dq[:, :, rows] += g_q
            dk_all[:, :, start:end] += g_k
            dv_all[:, :, start:end] += g_v
            if start > 0:
                g_q, g_k, g_v = _flash_backward(go, q_c, k_all[:, :, :start], v_all[:, :, :start], o, l_c, 0.0, False,
                                                scale=scale)
                dq[:, :, rows] += g_q
                dk_all[:, :, :start] += g_k
                dv_all[:, :, :start] += g_v
        return dq, _reduce_scatter_sequence(dk_all, group), _reduce_scatter_sequence(dv_all, group), None, None


def causal_attention(query_sbhd: torch.Tensor, key_sbgd: torch.Tensor, value_sbgd: torch.Tensor, scale: float,
                     cp_group: Any = None) -> torch.Tensor:
    """Causal attention in Megatron's layout: query [s, b, heads, dk], key [s, b, groups, dk],
    value [s, b, groups, dv] (s local under CP) -> [s, b, heads, dv]."""
    dk, dv = query_sbhd.shape[-1], value_sbgd.shape[-1]
    width = max(dk, dv)
    # The CPU flash kernel wants one head size for q, k and v: zero-padding q and k leaves the
    # scores unchanged, zero-padding v adds output columns that are dropped.
    q = torch.nn.functional.pad(query_sbhd, (0, width - dk)) if dk < width else query_sbhd
    k = torch.nn.functional.pad(key_sbgd, (0, width - dk)) if dk < width else key_sbgd
    v = torch.nn.functional.pad(value_sbgd, (0, width - dv)) if dv < width else value_sbgd
    out = _CausalFlashAttention.apply(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                      scale, cp_group if _size(cp_group) > 1 else None)
    return out.permute(2, 0, 1, 3)[..., :dv]


class CausalAttention(MegatronModule):
    """Core attention (drop-in for Megatron's `DotProductAttention` in a layer spec, including
    MLA's `k_channels` / `v_channels`): causal, flash-style, context parallel. No dropout, no
    sliding window, no learnable softmax offset (none of the supported families uses them)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"CausalAttention is causal-only; the layer spec asks for {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError(f"CausalAttention has no attention dropout (config asks for {dropout})")
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise NotImplementedError("CausalAttention supports vanilla softmax over the full causal context only "
                                      f"(softmax_type={config.softmax_type}, window_size={config.window_size})")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type  # the CPU path always all-gathers keys and values
        k_channels = k_channels or config.kv_channels
        # Megatron's apply_query_key_layer_scaling divides the scale by the layer number and
        # multiplies the scores back in fp32: the same softmax, so it is not repeated here.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            self.cp_group = pg_collection.cp
        else:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        if config.context_parallel_size != _size(self.cp_group):
            raise ValueError(f"context_parallel_size={config.context_parallel_size} but the CP group has "
                             f"{_size(self.cp_group)} ranks")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        """query [sq, b, np, hn], key [sk, b, ng, hn], value [sk, b, ng, hv] -> [sq, b, np * hv]."""
        if attention_mask is not None:
            raise ValueError("CausalAttention is causal by position: call the model with attention_mask=None "
                             "(a dense mask would be [s, s])")
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise NotImplementedError(f"CausalAttention is causal-only, got attn_mask_type={attn_mask_type}")
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("CausalAttention takes neither an attention bias nor packed (THD) sequences: "
                                      "trajectories are packed one per row (training/batches.py)")
        if query.shape[0] != key.shape[0]:
            raise ValueError(f"self-attention expects as many keys as queries, got {key.shape[0]} and {query.shape[0]}")
        if _size(self.cp_group) > 1 and query.shape[0] % 2:
            raise ValueError("under context parallelism the local sequence holds two equal chunks; got "
                             f"{query.shape[0]} positions")
        context = causal_attention(query, key, value, self.softmax_scale, self.cp_group)
        return context.reshape(context.shape[0], context.shape[1], -1)
