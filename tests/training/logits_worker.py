"""What each rank runs in tests/training/test_logits.py: log-probs and entropy from whole logits and
from sequence chunks, with the parameter gradients of each."""

from __future__ import annotations

import torch

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
