"""Argument checks shared by the algorithm functions.

Every public function in `megatron_sao.algo` takes `[B, T]` tensors that must agree in shape and
device; a mistake there (a `[T]` row, a float mask, a transposed tensor) would otherwise broadcast
silently into a wrong loss. These helpers raise `ValueError` naming the offending argument.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.float64)


def check_mask(loss_mask: torch.Tensor, name: str = "loss_mask") -> None:
    """A `[B, T]` bool mask (True on action tokens)."""
    if not isinstance(loss_mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(loss_mask).__name__}")
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (True on action tokens), got {loss_mask.dtype}")
    if loss_mask.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(loss_mask.shape)}")


def check_like_mask(tensor: torch.Tensor, name: str, loss_mask: torch.Tensor, *,
                    dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """`tensor` has the mask's shape and device, and (optionally) one of `dtypes`."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != loss_mask.shape:
        raise ValueError(f"{name} must have the shape of loss_mask {tuple(loss_mask.shape)}, "
                         f"got {tuple(tensor.shape)}")
    if tensor.device != loss_mask.device:
        raise ValueError(f"{name} is on {tensor.device} but loss_mask is on {loss_mask.device}")
    if dtypes is not None and tensor.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {tensor.dtype}")
    if dtypes is None and not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def check_unit_interval(value: float, name: str) -> float:
    """A float in [0, 1]."""
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def row_lambda(lam: float | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """`lam` as a float64 `[B]` tensor on `device`, checked to lie in [0, 1]."""
    if isinstance(lam, torch.Tensor):
        if lam.dim() == 0:
            lam_b = lam.detach().to(device=device, dtype=torch.float64).expand(batch)
        elif lam.shape == (batch,):
            if not lam.is_floating_point():
                raise ValueError(f"lam must be a floating-point tensor, got {lam.dtype}")
            lam_b = lam.detach().to(device=device, dtype=torch.float64)
        else:
            raise ValueError(f"lam must be a float or a [B] = [{batch}] tensor, got shape {tuple(lam.shape)}")
        if batch and not bool(((lam_b >= 0) & (lam_b <= 1)).all()):
            raise ValueError("lam must lie in [0, 1] for every row")
        return lam_b.contiguous()
    return torch.full((batch,), check_unit_interval(lam, "lam"), dtype=torch.float64, device=device)


def normaliser(num_tokens: float | int | torch.Tensor | None, loss_mask: torch.Tensor,
               ref: torch.Tensor) -> torch.Tensor:
    """The loss denominator as a 0-dim tensor of `ref`'s dtype and device.

    None means the local action-token count. A count below 1 becomes 1, so a batch (or a global
    batch) with no action token gives a zero loss instead of 0/0 = NaN; an explicit Python number
    must be positive.
    """
    if num_tokens is None:
        count = loss_mask.sum().to(ref.dtype)
    elif isinstance(num_tokens, torch.Tensor):
        if num_tokens.numel() != 1:
            raise ValueError(f"num_tokens must be a scalar, got shape {tuple(num_tokens.shape)}")
        count = num_tokens.detach().reshape(()).to(device=ref.device, dtype=ref.dtype)
    else:
        value = float(num_tokens)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"num_tokens must be a positive finite number, got {num_tokens}")
        return torch.tensor(value, dtype=ref.dtype, device=ref.device)
    return count.clamp_min(1.0)
