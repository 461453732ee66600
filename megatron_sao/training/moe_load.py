"""Expert load per MoE layer: how many real tokens the router sends to each expert.

A forward hook on every router counts, per layer, the tokens routed to each expert while
`tracking(token_mask)` is active (the actor's training forward: not a recomputation in backward,
not a forward-only pass). Padding tokens are routed too (Megatron routes every position) but are
left out of the counts. The router sees `[s, b]` tokens flattened s-major, and under sequence
parallelism only this tensor-parallel rank's sequence chunk; the mask is cut the same way.

`max_over_mean` of a layer is the load of its busiest expert over the mean load: 1 is perfect
balance, num_experts / topk the worst case (every token on the same experts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_sao.platform.device import compute_device


class RouterLoadTracker:
    """Counts routed tokens per (layer, expert) over the forwards it is asked to track."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self._routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        config = chunks[0].config
        self.num_layers = int(config.num_layers)
        self.num_experts = int(config.num_moe_experts or 0)
        self._token_mask_sb: torch.Tensor | None = None
        self._counts_le = torch.zeros(self.num_layers, max(self.num_experts, 1), dtype=torch.float64,
                                      device=compute_device())
        self._handles = [router.register_forward_hook(self._hook) for router in self._routers]

    @contextlib.contextmanager
    def tracking(self, token_mask_bt: torch.Tensor) -> Iterator[None]:
        """Count the routing of forwards run inside this block; `token_mask_bt` marks real tokens."""
        self._token_mask_sb = token_mask_bt.transpose(0, 1)
        try:
            yield
        finally:
            self._token_mask_sb = None

    def _hook(self, router: torch.nn.Module, inputs: tuple, output: tuple) -> None:
        if self._token_mask_sb is None:
            return
        routing_map_ne = output[1]
        valid = self._local_token_mask(routing_map_ne.shape[0])
        counts_e = routing_map_ne.detach()[valid].sum(dim=0) if valid is not None else routing_map_ne.sum(dim=0)
        self._counts_le[router.layer_number - 1] += counts_e.to(self._counts_le)

    def _local_token_mask(self, num_tokens: int) -> torch.Tensor | None:
        from megatron.core import parallel_state

        mask_sb = self._token_mask_sb
        assert mask_sb is not None
        seq, batch = mask_sb.shape
        local_seq = num_tokens // max(batch, 1)
        if local_seq * batch != num_tokens or seq % max(local_seq, 1):
            return None  # an unexpected token layout: count every token rather than guess
        chunk = seq // local_seq
        rank = parallel_state.get_tensor_model_parallel_rank() if chunk > 1 else 0
        return mask_sb[rank * local_seq:(rank + 1) * local_seq].reshape(-1)

    def collect(self) -> dict[str, float]:
        """Collective: reset the counts and return `moe/max_over_mean_load` (worst layer) and
        `moe/max_over_mean_load/layer_{i}` (1-based layers), summed over all ranks."""
        counts_le = self._counts_le.clone()
        self._counts_le.zero_()
        torch.distributed.all_reduce(counts_le)
        if self.num_experts == 0:
            return {}
        mean_l = counts_le.mean(dim=1)
        ratio_l = torch.where(mean_l > 0, counts_le.max(dim=1).values / mean_l.clamp_min(1e-12), torch.nan)
        out = {f"moe/max_over_mean_load/layer_{i + 1}": ratio
               for i, (ratio, mean) in enumerate(zip(ratio_l.tolist(), mean_l.tolist(), strict=True)) if mean > 0}
        if out:
            out["moe/max_over_mean_load"] = max(out.values())
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
