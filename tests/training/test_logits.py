"""Log-probs and entropy from the actor's logits in sequence chunks (`actor.logits_chunk_tokens`):
the same values and parameter gradients as from whole logits, with the output layer never producing
more than one chunk of logits at a time, under TP 2 with sequence parallelism (gloo, tiny Qwen3-MoE)."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.platform import run_distributed

BATCH, SEQ, TEMPERATURE = 2, 40, 0.7


def _batch() -> dict[str, torch.Tensor]:
    from megatron_sao.models.outputs import position_ids_for, shifted_labels

    ids = torch.randint(0, 300, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "position_ids": position_ids_for(ids), "labels": shifted_labels(ids)}


def chunked_vs_whole(hf_dir: str) -> dict:
    import torch.distributed as dist

    from megatron_sao.config import load_config
    from megatron_sao.models import build_model
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.training.logits import label_logprobs_and_entropy
    from megatron_sao.training.steps import label_outputs_forward, model_forward

    world = dist.get_world_size()
    cfg = load_config(None, [f"model.hf_path={hf_dir}", "model.dtype=float32", f"parallelism.world_size={world}",
                             f"parallelism.tensor={world}", "logging.param_table=false"])
    init_model_parallel(cfg.parallelism, seed=cfg.run.seed)
    model = build_model(cfg, "actor").chunks[0]
    batch = _batch()
    weights = torch.randn(BATCH, SEQ, generator=torch.Generator().manual_seed(9))
    rows_seen: list[int] = []
    model.output_layer.register_forward_hook(lambda m, i, out: rows_seen.append(out[0].shape[0] * out[0].shape[1]))

    def run(forward) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        rows_seen.clear()
        logprobs, entropy = forward(model, batch)
        (logprobs * weights).sum().backward()
        return logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def whole(m, b):
        return label_logprobs_and_entropy(model_forward(m, b), b["labels"], TEMPERATURE)

    out = {"whole": run(whole)}
    out["one_chunk"] = run(label_outputs_forward(TEMPERATURE, None))
    out["chunked"] = run(label_outputs_forward(TEMPERATURE, 12))
    out["chunked_rows"] = list(rows_seen)  # forward and backward recomputation, tokens x TP rows each
    return out


# TP 2 with sequence parallelism (chunks hold rows of every TP slice) in the default suite.
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_chunked_logprobs_equal_whole_logits(ranks, tiny_hf_dir):
    result = run_distributed(chunked_vs_whole, ranks, str(tiny_hf_dir))[0]
    whole = result["whole"]
    for name in ("one_chunk", "chunked"):
        logprobs, entropy, grads = result[name]
        torch.testing.assert_close(logprobs, whole[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(entropy, whole[1], rtol=0, atol=1e-6)
        assert grads.keys() == whole[2].keys()
        for key, grad in grads.items():
            # The output layer's gradient is summed chunk by chunk: round-off of that order only.
            scale = float(whole[2][key].abs().max())
            torch.testing.assert_close(grad, whole[2][key], rtol=0, atol=1e-6 * scale, msg=f"{name} {key}")
    # 12 tokens a chunk = 6 positions x 2 rows (under SP each TP rank's 6 rows of each slice):
    # no output-layer call ever sees more, in the forward or in the backward's recomputation.
    rows = result["chunked_rows"]
    assert max(rows) <= 12 and sum(rows) == 2 * BATCH * SEQ
