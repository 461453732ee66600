"""The CPU layer spec's causal attention: equal to dense softmax attention with a causal mask, in
values and gradients, without context parallelism and with CP 2 / 4 over gloo (keys and values
gathered, chunks r and 2CP-1-r per rank), for GQA and MLA head shapes."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.models.cpu_attention import causal_attention
from megatron_sao.platform import run_distributed

SEQ, BATCH = 24, 2


def dense_reference(q, k, v, scale):
    """[s, b, h, d] softmax attention with an explicit causal mask (the old local path)."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v)


def inputs(heads: int, groups: int, dk: int, dv: int):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(SEQ, BATCH, heads, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(SEQ, BATCH, groups, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(SEQ, BATCH, groups, dv, generator=gen, dtype=torch.float64)
    grad = torch.randn(SEQ, BATCH, heads, dv, generator=gen, dtype=torch.float64)
    return q, k, v, grad


SHAPES = {"gqa": (4, 2, 16, 16), "mla": (4, 4, 24, 16), "wide_v": (2, 1, 8, 12)}


def values_and_grads(fn, q, k, v, grad):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_dense_causal_attention(shape):
    q, k, v, grad = inputs(*SHAPES[shape])
    scale = q.shape[-1] ** -0.5
    ours = values_and_grads(lambda a, b, c: causal_attention(a, b, c, scale), q, k, v, grad)
    ref = values_and_grads(lambda a, b, c: dense_reference(a, b, c, scale), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref, strict=True):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-10), f"{name}: {(a - b).abs().max()}"


def _local(x: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    chunks = x.chunk(2 * cp, dim=0)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=0)


def cp_worker(shapes: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed as dist

    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    out = {}
    for shape in shapes:
        q, k, v, grad = inputs(*SHAPES[shape])
        scale = q.shape[-1] ** -0.5
        local = [_local(t, rank, cp) for t in (q, k, v, grad)]
        got = values_and_grads(lambda a, b, c, scale=scale: causal_attention(a, b, c, scale, group), *local)
        out[shape] = dict(zip(("out", "dq", "dk", "dv"), got, strict=True))
    return out


# One spawn per CP size (starting ranks dominates the cost); CP 4 is slow (4 processes).
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_matches_dense(cp):
    shapes = list(SHAPES)
    per_rank = run_distributed(cp_worker, cp, shapes)
    for shape in shapes:
        q, k, v, grad = inputs(*SHAPES[shape])
        scale = q.shape[-1] ** -0.5
        ref = dict(zip(("out", "dq", "dk", "dv"),
                       values_and_grads(lambda a, b, c, scale=scale: dense_reference(a, b, c, scale), q, k, v, grad),
                           strict=True))
        for rank, got in enumerate(per_rank):
            for name, tensor in got[shape].items():
                expected = _local(ref[name], rank, cp)
                assert torch.allclose(tensor, expected, atol=1e-10), \
                    f"{shape} rank {rank} {name}: {(tensor - expected).abs().max()}"
