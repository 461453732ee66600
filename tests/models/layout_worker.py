"""What every rank runs in the layout tests: build actor + critic in a given parallel layout,
take their outputs on a fixed batch, then one real Megatron optimizer step each."""

from __future__ import annotations

import torch

SEQ, BATCH = 16, 2


def fixed_batch(vocab: int = 300) -> dict[str, torch.Tensor]:
    from megatron_sao.models.outputs import position_ids_for, shifted_labels

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "position_ids": position_ids_for(ids), "labels": shifted_labels(ids),
            "value_targets": torch.randn(BATCH, SEQ, generator=g)}


def _full_logits(chunks, batch):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_sao.training.forward_backward import run_forward_backward
    from megatron_sao.training.steps import model_forward

    out = run_forward_backward(chunks, [batch], model_forward, loss_fn=None, forward_only=True)
    local = out[0].detach() if out else None
    if local is not None:
        local = gather_from_tensor_model_parallel_region(local.contiguous())
    return local


def run_layout(hf_dir: str, overrides: list[str]) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_sao.config import load_config
    from megatron_sao.models import build_model
    from megatron_sao.models.outputs import values_from_head
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.training.forward_backward import broadcast_from_last_stage, run_forward_backward
    from megatron_sao.training.optim import build_optimizer, ddp_config_for, optimizer_step, zero_grads
    from megatron_sao.training.steps import model_forward, token_loss_forward

    world = dist.get_world_size()
    cfg = load_config(None, [f"model.hf_path={hf_dir}", "model.dtype=float32", f"parallelism.world_size={world}",
                             "actor.optim.lr=1e-2", "critic.optim.lr=1e-2", "logging.param_table=false",
                             *overrides])
    init_model_parallel(cfg.parallelism, seed=cfg.run.seed)
    batch = fixed_batch()
    result: dict = {}
    for role in ("actor", "critic"):
        optim_cfg = getattr(cfg, role).optim
        built = build_model(cfg, role, wrap_with_ddp=True, ddp_config=ddp_config_for(optim_cfg))
        chunks = built.chunks
        for c in chunks:
            c.eval()
        out = _full_logits(chunks, batch)
        if role == "actor":
            vocab = out.shape[-1] if out is not None else 0
            vocab_t = torch.tensor([vocab])
            dist.all_reduce(vocab_t, op=dist.ReduceOp.MAX)
            result["logits"] = broadcast_from_last_stage(out, (BATCH, SEQ, int(vocab_t)))
        else:
            values = values_from_head(out) if out is not None else None
            result["values"] = broadcast_from_last_stage(values, (BATCH, SEQ))
        for c in chunks:
            c.train()

        opt = build_optimizer(chunks, optim_cfg, total_steps=10)
        before = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
        zero_grads(opt)

        forward_fn = token_loss_forward if role == "actor" else model_forward

        def loss_fn(output, b, role=role):
            token_loss = output.float() if role == "actor" else (values_from_head(output) - b["value_targets"]) ** 2
            n = torch.tensor(token_loss.numel(), dtype=torch.int)
            return token_loss.sum(), n, {"loss": token_loss.sum().detach()}

        run_forward_backward(chunks, [batch, batch], forward_fn, loss_fn)
        frozen_grads = [n for c in chunks for n, p in c.named_parameters()
                        if not p.requires_grad and (p.grad is not None or getattr(p, "main_grad", None) is not None)]
        applied, grad_norm = optimizer_step(opt)
        changed = {n: not torch.equal(before[n], p.detach()) for c in chunks for n, p in c.named_parameters()}
        trainable = {n: p.requires_grad for c in chunks for n, p in c.named_parameters()}
        result[role] = {
            "applied": applied,
            "grad_norm": grad_norm,
            "frozen_with_grad": frozen_grads,
            "frozen_changed": sorted(n for n, t in trainable.items() if not t and changed[n]),
            "trainable_unchanged": sorted(n for n, t in trainable.items() if t and not changed[n]),
            "num_frozen": sum(not t for t in trainable.values()),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        }
    return result
