"""R3 routing replay in the actor: its routers choose the experts the rollout engine chose.

Megatron-Core 0.19.2 has the mechanism (`transformer/moe/router_replay.py`): with
`TransformerConfig.moe_enable_routing_replay` every `TopKRouter` owns a `RouterReplay`;
`set_target_indices(idx)` gives it a micro-batch's top-k indices `[tokens, k]`, and
`set_router_replay_action(REPLAY_FORWARD)` makes its top-k step use them (the routing
probabilities are the router's own scores gathered at those experts, so gradients still reach the
router). `REPLAY_BACKWARD` pops the indices of the oldest forward in FIFO order, for a layer
recomputed in the backward (activation recomputation): the forwards of one schedule run
set their targets under REPLAY_FORWARD and leave every router in REPLAY_BACKWARD, so a recompute
anywhere in the backward (also 1F1B with several micro-batches in flight) replays its own forward.
The TE-fused top-k (`moe_router_fusion`) bypasses the replay, so models/build.py turns it off.

What this module adds around it, per router instance (`_ReplayWithFallback`):
- a token the record has no routing for (`NOT_ROUTED`: padding, a token the engine did not
  route, a trajectory without routing) uses the router's own top-k, computed from the same
  scores;
- `moe/routing_agreement`: in the update's forwards, the share of routed (token, layer) choices
  whose top-k set, as the actor's router computes it before replay, equals the engine's.

`RoutingReplayer` holds the replay instances of this rank's MoE layers (its pipeline stage, every
virtual stage) in the record's MoE-layer order and feeds each forward the micro-batch's
`routed_experts` `[b, s, L_local, k]` (this rank's layers and sequence part only,
training/routing_shards.py). The critic is built without replay: it routes itself.

Shape legend: b rows, s sequence positions this rank's routers see, L MoE layers, k top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_sao.rollout.routing import NOT_ROUTED

ForwardFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]


def moe_layer_pattern(config: Any) -> list[int]:
    """1 for each MoE decoder layer, as Megatron-Core builds them
    (`models/gpt/gpt_layer_specs.py::get_gpt_decoder_layer_specs` reads `moe_layer_freq`)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return [int(x) for x in freq]


class _ReplayWithFallback:
    """Wraps one `RouterReplay.get_replay_topk`: NOT_ROUTED rows fall back to the router's own
    top-k; agreement with the engine is counted while `counting`."""

    def __init__(self, replay: Any, stats: dict[str, torch.Tensor]) -> None:
        self.replay = replay
        self.stats = stats
        self.counting = False
        self._megatron_topk = replay.get_replay_topk
        replay.get_replay_topk = self

    def __call__(self, scores: torch.Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None,
                 default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay, action = self.replay, self.replay.router_replay_action
        forward = action == RouterReplayAction.REPLAY_FORWARD
        if forward or action == RouterReplayAction.REPLAY_BACKWARD:
            target = replay.target_topk_idx if forward else replay.replay_backward_list[0]
            _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target = target.to(own.device)
            unrouted = target[:, 0] == NOT_ROUTED
            merged = torch.where(unrouted[:, None], own, target)
            if forward:
                replay.target_topk_idx = merged
                if self.counting:
                    same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1) & ~unrouted
                    self.stats["agree"] += same.sum().to(self.stats["agree"])
                    self.stats["routed"] += (~unrouted).sum().to(self.stats["routed"])
            else:
                replay.replay_backward_list[0] = merged
        return self._megatron_topk(scores, topk, num_groups, group_topk, default_compute_topk)


class RoutingReplayer:
    """The actor's routers on this rank, replaying `micro_batch["routed_experts"]`."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        config = chunks[0].config
        device = next(chunks[0].parameters()).device
        if not config.moe_enable_routing_replay:
            raise ValueError("routing replay needs the actor built with moe_enable_routing_replay")
        pattern = moe_layer_pattern(config)
        moe_index = {layer: sum(pattern[:layer]) for layer in range(len(pattern)) if pattern[layer]}
        self.stats = {"agree": torch.zeros((), dtype=torch.float64, device=device),
                      "routed": torch.zeros((), dtype=torch.float64, device=device)}
        self.layers: list[int] = []
        """Record MoE-layer indices of this rank's routers, in payload order."""
        self._per_chunk: dict[int, list[tuple[_ReplayWithFallback, int]]] = {}
        self._all: list[_ReplayWithFallback] = []
        for chunk in chunks:
            slots = []
            for module in chunk.modules():
                if not isinstance(module, TopKRouter) or module.router_replay is None or module.is_mtp_layer:
                    continue
                wrapped = _ReplayWithFallback(module.router_replay, self.stats)
                slots.append((wrapped, len(self.layers)))
                self.layers.append(moe_index[module.layer_number - 1])
                self._all.append(wrapped)
            self._per_chunk[id(chunk)] = slots
        # Megatron also lists every instance in a process-wide list (for its inference engine); this
        # module addresses its instances directly, and a second model built in the process (tests)
        # must not find these in that list.
        mine = {id(w.replay) for w in self._all}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]

    def wrap(self, forward_fn: ForwardFn, count_agreement: bool = False) -> ForwardFn:
        """`forward_fn` with the micro-batch's routing replayed on this chunk's routers (the
        router's own routing when the micro-batch carries none)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def forward(model: torch.nn.Module, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
            routed_bslk = micro_batch.get("routed_experts")
            slots = self._per_chunk.get(id(model), [])
            if routed_bslk is None or not slots:
                for wrapped, _ in slots:
                    wrapped.replay.set_router_replay_action(None)
                return forward_fn(model, micro_batch)
            device = micro_batch["input_ids"].device
            indices_sblk = routed_bslk.to(device=device, dtype=torch.int64).transpose(0, 1)
            for wrapped, slot in slots:
                # Megatron's router sees [s, b] tokens flattened s-major (router.py: logits.view(-1, E)).
                wrapped.replay.set_target_indices(indices_sblk[:, :, slot, :].reshape(-1, indices_sblk.shape[-1]))
                wrapped.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                wrapped.counting = count_agreement
            try:
                return forward_fn(model, micro_batch)
            finally:
                for wrapped, _ in slots:
                    wrapped.replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                    wrapped.counting = False

        return forward

    def release(self) -> None:
        """After a schedule run: drop every target and leave the routers routing themselves."""
        for wrapped in self._all:
            wrapped.replay.clear_indices()
            wrapped.replay.clear_router_replay_action()

    def collect_agreement(self) -> dict[str, float]:
        """Collective: `moe/routing_agreement` over every rank's counts since the last call."""
        counts = torch.stack([self.stats["agree"], self.stats["routed"]])
        torch.distributed.all_reduce(counts)
        for value in self.stats.values():
            value.zero_()
        agree, routed = counts.tolist()
        return {"moe/routing_agreement": agree / routed} if routed else {}
