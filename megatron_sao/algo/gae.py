"""Skip-observation token-level GAE (SAO section 4) and the length-adaptive lambda.

GAE runs over the action tokens of each row only: observation, prompt and padding positions get
no advantage and no value target, and the last token of one action span bootstraps directly from
the first token of the next. The fast path below computes exactly that recurrence in four steps
per chunk of rows, with no per-token Python loop:

1. compact: the column of every action token, left-aligned into `[G, K]` (K = most action tokens
   of a row in the chunk, rounded up to the scan block); padding slots point one past the end;
2. rewards: from a prefix sum along the row, the sum of the rewards before each action column;
   the difference of consecutive entries is the reward credited to each action token, which
   moves a reward on a non-action position to the nearest preceding action token and drops
   rewards before the first one;
3. scan: A_k = delta_k + c * A_{k+1} (c = gamma * lambda per row) as a blocked scan: within a
   block of `_BLOCK` tokens a batched matmul with the upper-triangular Toeplitz matrix
   c^(j - i), then the same scan, recursively, over the block heads with c^_BLOCK, then one fused
   multiply-add carries each block's successor into it. Only non-negative powers of c appear, so
   nothing overflows however long the row or small c is, and accumulation is in float64;
4. scatter: advantages and returns back to their columns of zeroed output rows.

On CPU rows are processed in chunks of about `_CPU_CHUNK_ELEMENTS` tokens so that every
intermediate of a chunk stays in cache: the large inputs come from memory about once and the
outputs go to memory once. On GPU a chunk of `_GPU_CHUNK_ELEMENTS` tokens holds the paper's whole
128 x 131,072 batch and bounds the temporaries to a few GB.

Legend: B trajectories, T tokens per trajectory, G rows in a chunk, K compacted action slots,
N blocks of `_BLOCK` slots, L = `_BLOCK`.
"""

from __future__ import annotations

import torch

from megatron_sao.algo._checks import FLOAT_DTYPES, check_like_mask, check_mask, check_unit_interval, row_lambda

_BLOCK = 32
_CPU_CHUNK_ELEMENTS = 1 << 19
_GPU_CHUNK_ELEMENTS = 1 << 25


def length_adaptive_lambda(num_action_tokens: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """VAPO's length-adaptive lambda, `1 - 1 / (alpha * l)` clamped to [0, 1], one per trajectory.

    Long trajectories get lambda close to 1 so that the terminal reward still reaches their first
    tokens; short ones lean on the critic. `l = 0` (no action token) gives 0. The result is
    float64 whatever the input: for l ~ 1e5 the value differs from 1 by ~7e-6, and a float32
    round-off of that size changes lambda^l by a few percent.
    """
    if not isinstance(num_action_tokens, torch.Tensor) or num_action_tokens.dim() != 1:
        raise ValueError("num_action_tokens must be a 1-D [B] tensor")
    alpha = float(alpha)
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    length_b = num_action_tokens.detach().to(torch.float64)
    if bool((length_b < 0).any()):
        raise ValueError("num_action_tokens must be non-negative")
    lam_b = 1.0 - 1.0 / (alpha * torch.where(length_b > 0, length_b, 1.0))
    return torch.where(length_b > 0, lam_b, 0.0).clamp(0.0, 1.0)


class _ScanLevel:
    """Per-row constants of one level of the blocked scan, for every row of the batch."""

    __slots__ = ("carry_pow_bl", "toeplitz_bll")

    def __init__(self, c_b: torch.Tensor) -> None:
        steps = torch.arange(_BLOCK, device=c_b.device, dtype=torch.float64)
        gap_ll = steps[:, None] - steps[None, :]  # j - i for row j, column i
        powers_bll = c_b[:, None, None] ** gap_ll.clamp_min(0.0)
        # toeplitz[j, i] = c^(j - i) for j >= i: (x @ toeplitz)[i] = sum_{j >= i} c^(j - i) x[j].
        self.toeplitz_bll = torch.where(gap_ll >= 0, powers_bll, 0.0)
        # The value at the head of the next block reaches slot i of this block with c^(L - i).
        self.carry_pow_bl = c_b[:, None] ** (_BLOCK - steps)


def _scan_levels(c_b: torch.Tensor, max_len: int) -> list[_ScanLevel]:
    """Constants for every level a row of `max_len` slots needs (c, c^L, c^(L^2), ...)."""
    levels = [_ScanLevel(c_b)]
    span = _BLOCK
    while span < max_len:
        c_b = c_b**_BLOCK
        levels.append(_ScanLevel(c_b))
        span *= _BLOCK
    return levels


def _reverse_scan(x_gk: torch.Tensor, levels: list[_ScanLevel], rows: slice) -> torch.Tensor:
    """A_k = x_k + c * A_{k+1} (A past the end = 0) along dim 1, for rows `rows` of the batch."""
    num_rows, length = x_gk.shape
    level = levels[0]
    if length <= _BLOCK:
        toeplitz = level.toeplitz_bll[rows, :length, :length]
        return torch.bmm(x_gk.unsqueeze(1), toeplitz).squeeze(1)
    num_blocks = -(-length // _BLOCK)
    if num_blocks * _BLOCK != length:
        x_gk = torch.nn.functional.pad(x_gk, (0, num_blocks * _BLOCK - length))
    local_gnl = torch.bmm(x_gk.view(num_rows, num_blocks, _BLOCK), level.toeplitz_bll[rows])
    heads_gn = _reverse_scan(local_gnl[:, :, 0].contiguous(), levels[1:], rows)
    carry_gn = torch.zeros_like(heads_gn)
    carry_gn[:, :-1] = heads_gn[:, 1:]
    out_gnl = local_gnl.addcmul_(carry_gn[:, :, None], level.carry_pow_bl[rows, None, :])
    return out_gnl.view(num_rows, num_blocks * _BLOCK)[:, :length]


def _chunk_rows(batch: int, num_tokens: int, device: torch.device) -> int:
    budget = _GPU_CHUNK_ELEMENTS if device.type == "cuda" else _CPU_CHUNK_ELEMENTS
    return max(1, min(batch, budget // max(num_tokens, 1)))


def _gae_chunk(rewards_gt: torch.Tensor, values_gt: torch.Tensor, mask_gt: torch.Tensor, gamma: float,
               levels: list[_ScanLevel], rows: slice, adv_gt: torch.Tensor, ret_gt: torch.Tensor) -> None:
    """Write advantages and returns of one chunk of rows into `adv_gt` and `ret_gt`."""
    num_rows, num_tokens = mask_gt.shape
    device = mask_gt.device
    adv_gt.zero_()
    ret_gt.zero_()
    # Action tokens in row-major order; rows come sorted, so a binary search counts them per row
    # (mask.sum would read the mask a second time, through an int64 copy).
    row_n, col_n = torch.nonzero(mask_gt, as_tuple=True)
    count_g = torch.searchsorted(row_n, torch.arange(num_rows + 1, device=device)).diff()
    max_count = int(count_g.max())
    if max_count == 0:
        return

    # 1. compact: col_gk[g, k] = column of the k-th action token of row g, T in padding slots.
    # One slot more than the scan needs, so that slot k + 1 always exists.
    slots = -(-max_count // _BLOCK) * _BLOCK
    slot_k = torch.arange(slots + 1, device=device)
    padding_gk = slot_k[None, :] >= count_g[:, None]
    col_gk = torch.full((num_rows, slots + 1), num_tokens, dtype=torch.long, device=device)
    col_gk.masked_scatter_(~padding_gk, col_n)

    # 2. rewards: prefix_gk[g, k] = sum of rewards of row g before column col_gk[g, k], read from
    # the inclusive prefix sum at the column before (the row total for padding slots, whose
    # column is T). Only slot 0 can sit at column 0, with nothing before it.
    cumsum_gt = torch.cumsum(rewards_gt, dim=1, dtype=torch.float64)
    prefix_gk = cumsum_gt.gather(1, torch.sub(col_gk, 1).clamp_(min=0))
    prefix_gk[:, 0].masked_fill_(col_gk[:, 0] == 0, 0.0)

    col_gk.clamp_(max=num_tokens - 1)  # padding slots now read (and later add 0 to) column T - 1
    value_gk = values_gt.gather(1, col_gk).masked_fill_(padding_gk, 0.0)
    value64_gk = value_gk.to(torch.float64)

    # delta_k = r_k + gamma * V_{k+1} - V_k; exactly 0 on padding slots (prefix and value constant).
    delta_gk = prefix_gk[:, 1:] - prefix_gk[:, :-1]
    delta_gk.add_(value64_gk[:, 1:], alpha=gamma).sub_(value64_gk[:, :-1])

    # 3. scan; padding slots sit after the last action token, so their advantage is exactly 0.
    adv_gk = _reverse_scan(delta_gk, levels, rows).to(adv_gt.dtype)
    ret_gk = adv_gk + value_gk[:, :-1]

    # 4. scatter back. Every action column receives exactly one value; padding slots add an exact
    # 0.0 to column T - 1, so the result is bitwise the same in any summation order (CUDA too).
    adv_gt.scatter_add_(1, col_gk[:, :-1], adv_gk)
    ret_gt.scatter_add_(1, col_gk[:, :-1], ret_gk)


@torch.no_grad()
def skip_observation_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and value targets of SAO's skip-observation GAE, both `[B, T]`.

    Args:
        rewards: float32 or float64 `[B, T]`. A reward on a non-action position counts at the
            nearest preceding action token (so a row ending on an observation, EOS or padding
            keeps its reward); rewards before the first action token are ignored.
        values: `[B, T]`, same dtype; `values[b, t]` is V of the state before token t. Only action
            positions are read.
        loss_mask: bool `[B, T]`, True on action (model-generated) tokens.
        gamma: discount per action token, in [0, 1].
        lam: GAE lambda in [0, 1]; a float, or a `[B]` tensor for one lambda per trajectory
            (e.g. `length_adaptive_lambda`).

    Returns:
        `(advantages, returns)` in the input dtype, exactly 0 at non-action positions and in rows
        without action tokens; `returns == advantages + values` on action tokens. The value after
        the last action token is 0: to bootstrap a truncated row from V(s_end), add
        `gamma * V(s_end)` to its reward at the last action token.

    No autograd graph is built: advantages and targets are constants for both losses.
    """
    check_mask(loss_mask)
    check_like_mask(rewards, "rewards", loss_mask, dtypes=FLOAT_DTYPES)
    check_like_mask(values, "values", loss_mask, dtypes=(rewards.dtype,))
    gamma = check_unit_interval(gamma, "gamma")
    batch, num_tokens = loss_mask.shape
    c_b = gamma * row_lambda(lam, batch, loss_mask.device)

    advantages = torch.empty_like(values, memory_format=torch.contiguous_format)
    returns = torch.empty_like(advantages)
    if batch == 0 or num_tokens == 0:
        return advantages, returns
    levels = _scan_levels(c_b, num_tokens)
    step = _chunk_rows(batch, num_tokens, loss_mask.device)
    for start in range(0, batch, step):
        rows = slice(start, min(start + step, batch))
        _gae_chunk(rewards[rows], values[rows], loss_mask[rows], gamma, levels, rows,
                   advantages[rows], returns[rows])
    return advantages, returns
