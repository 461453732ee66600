"""What spawned gloo ranks run in the checkpoint tests: build actor + critic in a layout, take real
Megatron optimizer steps on fixed batches, save / load through `training.checkpoint`, and
snapshot every parameter and optimizer-state tensor this rank holds."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from megatron_sao.training.optim import RoleOptimizer

SEQ, GLOBAL_BATCH, MICRO_BATCH = 16, 4, 2
EP2 = ["parallelism.expert=2"]
DP2 = ["parallelism.expert=1"]
TP2 = ["parallelism.tensor=2"]
PP2 = ["parallelism.pipeline=2"]


def build_roles(hf_dir: str, overrides: list[str], roles: tuple[str, ...] = ("actor", "critic"),
                total_steps: int = 10) -> dict[str, RoleOptimizer]:
    """(Re)initialise parallel state for the layout and build each role with its Megatron optimizer."""
    import torch.distributed as dist

    from megatron_sao.config import load_config
    from megatron_sao.models import build_model
    from megatron_sao.platform import init_model_parallel
    from megatron_sao.training.optim import build_optimizer, ddp_config_for

    cfg = load_config(None, [f"model.hf_path={hf_dir}", "model.dtype=float32",
                             f"parallelism.world_size={dist.get_world_size()}", "actor.optim.lr=1e-2",
                             "critic.optim.lr=1e-2", "actor.optim.lr_warmup_steps=2",
                             "critic.optim.lr_warmup_steps=2", "logging.param_table=false", *overrides])
    init_model_parallel(cfg.parallelism, seed=cfg.run.seed)
    out = {}
    for role in roles:
        optim_cfg = getattr(cfg, role).optim
        chunks = build_model(cfg, role, wrap_with_ddp=True, ddp_config=ddp_config_for(optim_cfg)).chunks
        out[role] = build_optimizer(chunks, optim_cfg, total_steps=total_steps)
    return out


def _micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's share of step `step`'s fixed global batch, as micro-batches."""
    from megatron.core import parallel_state as ps

    from megatron_sao.models.outputs import position_ids_for, shifted_labels

    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 300, (GLOBAL_BATCH, SEQ), generator=g)
    targets = torch.randn(GLOBAL_BATCH, SEQ, generator=g)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = GLOBAL_BATCH // dp
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    ids, targets = ids[mine], targets[mine]
    return [{"input_ids": ids[i:i + MICRO_BATCH], "position_ids": position_ids_for(ids[i:i + MICRO_BATCH]),
             "labels": shifted_labels(ids[i:i + MICRO_BATCH]),
             "value_targets": targets[i:i + MICRO_BATCH]} for i in range(0, per_rank, MICRO_BATCH)]


def train_steps(roles: dict[str, RoleOptimizer], first_step: int, num_steps: int) -> None:
    """Steps first_step + 1 .. first_step + num_steps: one optimizer step per role on fixed batches."""
    from megatron_sao.models.outputs import values_from_head
    from megatron_sao.training.forward_backward import run_forward_backward
    from megatron_sao.training.optim import optimizer_step, zero_grads

    for step in range(first_step + 1, first_step + num_steps + 1):
        for name, role in sorted(roles.items()):
            def forward_fn(model, b, name=name):
                labels = b["labels"] if name == "actor" else None
                return model(b["input_ids"], b["position_ids"], None, labels=labels)

            def loss_fn(output, b, name=name):
                loss = output.float() if name == "actor" else (values_from_head(output) - b["value_targets"]) ** 2
                return loss.sum(), torch.tensor(loss.numel(), dtype=torch.int), {"loss": loss.sum().detach()}

            zero_grads(role)
            run_forward_backward(role.chunks, _micro_batches(step), forward_fn, loss_fn)
            applied, _ = optimizer_step(role)
            assert applied, f"{name} step {step} skipped"


def snapshot(roles: dict[str, RoleOptimizer]) -> dict[str, torch.Tensor]:
    """Every parameter, optimizer-state tensor (exp_avg, exp_avg_sq, step), group LR and the scheduler
    step count this rank holds, by a name stable across processes of the same layout."""
    out: dict[str, torch.Tensor] = {}
    for name, role in roles.items():
        for i, chunk in enumerate(role.chunks):
            for pname, p in chunk.named_parameters():
                out[f"{name}/param/{i}/{pname}"] = p.detach().clone()
        inners = getattr(role.optimizer, "chained_optimizers", [role.optimizer])
        for j, inner in enumerate(inners):
            for g, group in enumerate(inner.optimizer.param_groups):
                out[f"{name}/lr/{j}/{g}"] = torch.tensor(group["lr"], dtype=torch.float64)
                for k, p in enumerate(group["params"]):
                    for key, value in inner.optimizer.state[p].items():
                        out[f"{name}/optim/{j}/{g}/{k}/{key}"] = torch.as_tensor(value).detach().clone()
        out[f"{name}/scheduler_steps"] = torch.tensor(role.scheduler.num_steps)
    return out


def resume_source(hf_dir: str, ckpt: str) -> dict[str, Any]:
    """EP2: 3 steps, save, 1 step, save, 2 steps -> S1 (snapshot after step 6)."""
    from megatron_sao.training.checkpoint import save_checkpoint

    roles = build_roles(hf_dir, EP2)
    train_steps(roles, 0, 3)
    save_checkpoint(Path(ckpt), 3, roles, {"step": 3, "data_position": 12}, keep_last=0)
    rng_after_save = torch.rand(4)
    train_steps(roles, 3, 1)
    save_checkpoint(Path(ckpt), 4, roles, {"step": 4, "data_position": 16}, keep_last=0)
    train_steps(roles, 4, 2)
    return {"state": snapshot(roles), "rng_after_save": rng_after_save}


def resume_and_reshard(hf_dir: str, ckpt: str, out: str) -> dict[str, Any]:
    """Fresh processes. EP2: load step 3, 3 steps -> S2. Then EP2 -> DP2: load step 3, re-save it, take
    step 4 and save. (The other layouts: `reshard_other_layouts`, slow.)"""
    from megatron_sao.training.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint

    ckpt_dir, out_dir = Path(ckpt), Path(out)
    result: dict[str, Any] = {"latest": str(find_latest_checkpoint(ckpt_dir))}
    roles = build_roles(hf_dir, EP2)
    result["trainer_state"] = load_checkpoint(ckpt_dir / "iter_0000003", roles)
    result["rng_after_load"] = torch.rand(4)
    train_steps(roles, 3, 3)
    result["state"] = snapshot(roles)

    roles = build_roles(hf_dir, DP2)
    load_checkpoint(ckpt_dir / "iter_0000003", roles)
    save_checkpoint(out_dir / "dp2", 3, roles, {"step": 3}, keep_last=0)
    train_steps(roles, 3, 1)
    save_checkpoint(out_dir / "dp2", 4, roles, {"step": 4}, keep_last=0)
    return result


def reshard_other_layouts(hf_dir: str, ckpt: str, out: str) -> None:
    """Fresh processes, after `resume_and_reshard`: EP2 -> TP2 -> TP1 (DP2): load step 3, re-save, load
    that, re-save; EP2 -> PP2: load, re-save."""
    from megatron_sao.training.checkpoint import load_checkpoint, save_checkpoint

    ckpt_dir, out_dir = Path(ckpt), Path(out)
    roles = build_roles(hf_dir, TP2)
    load_checkpoint(ckpt_dir / "iter_0000003", roles)
    save_checkpoint(out_dir / "tp2", 3, roles, {"step": 3}, keep_last=0)
    roles = build_roles(hf_dir, DP2)
    load_checkpoint(out_dir / "tp2" / "iter_0000003", roles)
    save_checkpoint(out_dir / "tp1", 3, roles, {"step": 3}, keep_last=0)
    roles = build_roles(hf_dir, PP2)
    load_checkpoint(ckpt_dir / "iter_0000003", roles)
    save_checkpoint(out_dir / "pp2", 3, roles, {"step": 3}, keep_last=0)


def save_then_die(hf_dir: str, ckpt: str, snapshot_path: str) -> None:
    """Plain (non-distributed) optimizer, DP2: saves at steps 1, 2, 3 (keep_last=2), snapshots step 3,
    then is killed inside the save of step 4, after every shard is written, before the rename."""
    import torch.distributed as dist

    from megatron_sao.training import checkpoint

    plain = ["actor.optim.use_distributed_optimizer=false", "critic.optim.use_distributed_optimizer=false"]
    roles = build_roles(hf_dir, DP2 + plain)
    for step in (1, 2, 3):
        train_steps(roles, step - 1, 1)
        checkpoint.save_checkpoint(Path(ckpt), step, roles, {"step": step}, keep_last=2)
    torch.save(snapshot(roles), f"{snapshot_path}.rank{dist.get_rank()}")
    train_steps(roles, 3, 1)

    def killed(partial: Path, final: Path) -> None:
        os._exit(17)

    checkpoint._commit = killed
    checkpoint.save_checkpoint(Path(ckpt), 4, roles, {"step": 4}, keep_last=2)


def _params(role: RoleOptimizer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for i, c in enumerate(role.chunks) for n, p in c.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _error(fn, *args) -> str:
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return "no error"


def after_kill(hf_dir: str, ckpt: str, snapshot_path: str, work: str) -> dict[str, Any]:
    """Fresh processes after `save_then_die`: resume from the latest complete checkpoint; load weights
    from every accepted path kind; then a flipped byte in one shard file."""
    import torch.distributed as dist

    from megatron_sao.checkpointing.hf_to_mcore import HfToMcoreRequest, convert_hf_to_mcore
    from megatron_sao.training.checkpoint import find_latest_checkpoint, load_checkpoint, load_model_weights

    ckpt_dir, work_dir = Path(ckpt), Path(work)
    converted = work_dir / "converted_actor"
    convert_hf_to_mcore(HfToMcoreRequest(hf_dir=Path(hf_dir), out_dir=converted, progress=False))
    plain = ["actor.optim.use_distributed_optimizer=false", "critic.optim.use_distributed_optimizer=false"]
    roles = build_roles(hf_dir, DP2 + plain)
    initial = _params(roles["actor"])
    latest = find_latest_checkpoint(ckpt_dir)
    result: dict[str, Any] = {"latest": str(latest), "trainer_state": load_checkpoint(latest, roles)}
    expected = torch.load(f"{snapshot_path}.rank{dist.get_rank()}")
    state = snapshot(roles)
    result["resumed_equal"] = state.keys() == expected.keys() and all(torch.equal(state[k], expected[k])
                                                                      for k in state)
    at_step3 = _params(roles["actor"])
    critic_at_step3 = _params(roles["critic"])

    actor = roles["actor"]
    loaded = {}
    for kind, path in {"run": ckpt_dir, "iter": latest, "role": latest / "actor", "converted": converted}.items():
        for c in actor.chunks:  # scramble so that a load that did nothing shows
            for p in c.parameters():
                p.data.fill_(0.5)
        loaded[kind] = {"dir": str(load_model_weights(path, "actor", actor.chunks)),
                        "matches": _same(_params(actor), initial if kind == "converted" else at_step3)}
    for c in roles["critic"].chunks:
        for p in c.parameters():
            p.data.zero_()
    loaded["critic_run"] = {"dir": str(load_model_weights(ckpt_dir, "critic", roles["critic"].chunks)),
                            "matches": _same(_params(roles["critic"]), critic_at_step3)}
    result["weights"] = loaded
    # a conversion (standard path) and every kind of weights load ran in this process by now
    result["fastio_loaded"] = sorted(m for m in sys.modules if m.startswith("megatron_sao.checkpointing.fastio"))
    empty = work_dir / "not_a_checkpoint"
    if dist.get_rank() == 0:
        empty.mkdir(exist_ok=True)
    dist.barrier()
    result["errors"] = {
        "bad_path": _error(load_model_weights, empty, "actor", actor.chunks),
        "wrong_role": _error(load_model_weights, latest / "critic", "actor", actor.chunks),
        "converted_as_critic": _error(load_model_weights, converted, "critic", roles["critic"].chunks),
    }

    shard = sorted((latest / "critic").glob("*.distcp"))[-1]
    if dist.get_rank() == 0:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier()
    result["flipped"] = str(shard)
    result["flipped_error"] = _error(load_checkpoint, latest, roles)
    return result


def async_save_round_trip(hf_dir: str, ckpt: str) -> dict[str, Any]:
    """The async save path forced on CPU: the checkpoint only becomes complete at finalize."""
    from megatron_sao.training import checkpoint

    checkpoint._async_supported = lambda: True
    roles = build_roles(hf_dir, EP2, roles=("actor",))
    train_steps(roles, 0, 1)
    before = snapshot(roles)
    final = checkpoint.save_checkpoint(Path(ckpt), 1, roles, {"step": 1}, keep_last=0, async_save=True)
    complete_before_finalize = final.is_dir()
    train_steps(roles, 1, 1)  # training goes on while the shards are written
    checkpoint.finalize_async_saves(blocking=True)
    roles = build_roles(hf_dir, EP2, roles=("actor",))
    checkpoint.load_checkpoint(final, roles)
    after = snapshot(roles)
    return {"complete_before_finalize": complete_before_finalize, "complete": final.is_dir(),
            "equal": before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)}


def resume_source_then_save_then_die(hf_dir: str, ckpt: str, source_path: str, killed_ckpt: str,
                                     snapshot_path: str) -> None:
    """The first launch of both checkpoint fixtures (one process start-up instead of two):
    `resume_source`, its result saved to `source_path`.rankN (this launch ends killed, so nothing
    comes back through `run_distributed`), then `save_then_die`."""
    import torch.distributed as dist

    torch.save(resume_source(hf_dir, ckpt), f"{source_path}.rank{dist.get_rank()}")
    save_then_die(hf_dir, killed_ckpt, snapshot_path)


def resume_and_reshard_then_after_kill(hf_dir: str, ckpt: str, out: str, target_path: str, killed_ckpt: str,
                                       snapshot_path: str, work: str) -> dict[str, Any]:
    """The second launch of both checkpoint fixtures, in fresh processes: `resume_and_reshard` (its
    result also saved to `target_path`.rankN first, so that a failure in the second half leaves the
    first half's tests their result), then `after_kill`."""
    import torch.distributed as dist

    target = resume_and_reshard(hf_dir, ckpt, out)
    torch.save(target, f"{target_path}.rank{dist.get_rank()}")
    return {"target": target, "after": after_kill(hf_dir, killed_ckpt, snapshot_path, work)}
