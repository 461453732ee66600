"""The critic's scalar value head: a drop-in for GPTModel's `output_layer`.

GPTModel's post-process calls `output_layer(hidden_states, weight=..., runtime_gather_output=...)`
and returns its output transposed to [b, s, out]; with this head out = 1, so the critic is
GPTModel with one module swapped and everything else (pipeline stages, checkpointing, DDP)
unchanged. The parameter is named `weight` because Megatron's `LanguageModule` looks up
`output_layer.weight` when it builds the sharded state dict.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig


class ValueHead(torch.nn.Module):
    """Linear hidden -> 1 (no bias), replicated across tensor-parallel ranks."""

    def __init__(self, config: TransformerConfig, init_std: float = 0.02, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.sequence_parallel = False  # GPTModel inspects this attribute of its output layer
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        # Its own generator: every rank of every layout (EP ranks consume the global RNG
        # differently while building experts) must start from the same head.
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=generator) * init_std)
        # Not tagged `sequence_parallel`: the head sees the full, gathered sequence on every TP
        # rank, so its gradient is already complete there and must not be summed over TP.

    def forward(self, hidden_sbh: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.config.sequence_parallel:
            # The LM head (ColumnParallelLinear) would all-gather the sequence itself.
            hidden_sbh = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_sbh, tensor_parallel_output_grad=False
            )
        return torch.nn.functional.linear(hidden_sbh, self.weight.to(hidden_sbh.dtype)), None
