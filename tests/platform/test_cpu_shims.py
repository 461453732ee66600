"""Each CPU shim removes the CUDA-only failure it exists for (run in a fresh process: shims patch
global state). Skipped where CUDA is present, since shims are then never applied."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.platform import run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims apply only without CUDA")


def _exercise_shims() -> dict:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import get_default_causal_mask

    from megatron_sao.platform import applied_cpu_shims

    out: dict = {"applied": applied_cpu_shims()}
    out["current_device"] = torch.cuda.current_device()
    out["mask_device"] = str(get_default_causal_mask(4).device)
    out["zeros_device"] = str(torch.zeros(2, device="cuda").device)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            use_cpu_initialization=True)
    cfg.sequence_parallel = True  # as under TP > 1 (the config refuses SP with TP = 1 at construction)
    norm = WrappedTorchNorm(cfg, 8)
    out["norm_sp_tagged"] = all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    out["norm_type"] = type(norm).__name__
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    out["stream_ok"] = torch.cuda.current_stream() is stream
    with torch.cuda.stream(stream):
        pass

    import megatron.core.optimizer.clip_grads as clip_grads

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    out["clipped_grad"] = p.grad.clone()

    from megatron.core.models.common.embeddings import rotary_pos_embedding

    class CpRank1Of2:  # a CP group's size() / rank(), as the rotary embedding asks for them
        def size(self) -> int:
            return 2

        def rank(self) -> int:
            return 1

    emb = torch.arange(8.0).view(8, 1, 1, 1)  # [s, 1, 1, d]: positions 0..7, 4 chunks of 2
    out["cp_pos_emb"] = rotary_pos_embedding.get_pos_emb_on_this_cp_rank(emb, 0, CpRank1Of2()).flatten()

    from megatron.core.tensor_parallel import checkpoint

    draws = []

    def noisy(t):
        draws.append(torch.rand(5))
        return (t.sin() * draws[-1]).sum()

    x = torch.randn(5, requires_grad=True)
    checkpoint(noisy, False, x).backward()  # forward, then the recomputation in the backward
    out["recompute_draws_equal"] = len(draws) == 2 and torch.equal(draws[0], draws[1])
    out["recomputed_grad_ok"] = torch.allclose(x.grad, x.detach().cos() * draws[0])
    return out


def test_shims_make_cuda_only_calls_work_on_cpu():
    (out,) = run_distributed(_exercise_shims, 1)
    assert set(out["applied"]) == {"current_device", "cuda_device_factories", "sequence_parallel_torch_norm",
                                   "dispatcher_streams", "grad_clip", "distributed_optimizer_param_types",
                                   "pos_emb_on_this_cp_rank", "cuda_rng_state"}
    assert out["current_device"] == "cpu"
    assert out["mask_device"] == "cpu" and out["zeros_device"] == "cpu"
    assert out["norm_sp_tagged"] and out["norm_type"] == "RMSNorm"
    assert out["stream_ok"]
    torch.testing.assert_close(out["clipped_grad"], torch.full((4,), 2.0 / (4.0 + 1e-6)))
    assert out["cp_pos_emb"].tolist() == [2.0, 3.0, 4.0, 5.0]  # CP rank 1 of 2: chunks 1 and 2
    # Megatron's activation checkpoint restores the (CPU) RNG state for its recomputation.
    assert out["recompute_draws_equal"] and out["recomputed_grad_ok"]


def _no_shims_norm_fails() -> str:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            use_cpu_initialization=True)
    cfg.sequence_parallel = True
    try:
        WrappedTorchNorm(cfg, 8)
    except AssertionError as e:
        return str(e)
    return "no error"


def test_without_the_shim_megatron_rejects_sequence_parallel_norms():
    # Fresh interpreter without apply_cpu_shims: the shim is what makes SP norms possible.
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        message = pool.apply(_no_shims_norm_fails)
    assert "sequence parallel not supported" in message
