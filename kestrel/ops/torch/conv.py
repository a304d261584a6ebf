"""Causal depthwise short convolution over a flat batch of variable-length sequences, with carried state."""

from __future__ import annotations

import torch


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                  initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t[c] = sum_i weight[c, i] * x_{t-W+1+i}[c] within each sequence (no activation, no bias).

    x: [T, C]; weight: [C, W]; cu_seqlens: [N+1] int64; initial_state: [N, W-1, C], the W-1 inputs that precede
    each sequence (zeros when None). Returns y [T, C] in x's dtype (computed in the weight's dtype, fp32 for the
    family's checkpoints) and final_state [N, W-1, C]: the last W-1 inputs of each sequence, state included, so a
    zero-length sequence returns its state unchanged.
    """
    num_tokens, channels = x.shape
    width = weight.shape[1]
    n = cu_seqlens.numel() - 1
    if initial_state is None:
        initial_state = x.new_zeros(n, width - 1, channels)
    # Rows of `source`: every sequence's state rows first, then the new tokens.
    source = torch.cat([initial_state.reshape(n * (width - 1), channels).to(x.dtype), x])
    lens = cu_seqlens.diff()
    seq = torch.repeat_interleave(torch.arange(n, device=x.device), lens)
    local = torch.arange(num_tokens, device=x.device) - cu_seqlens[seq]
    taps = torch.arange(width, device=x.device)
    # Extended position e of sequence n (its state occupies e < W-1) maps to a row of `source`.
    ext = local.unsqueeze(1) + taps                                            # [T, W]
    y_rows = _source_rows(seq.unsqueeze(1), ext, cu_seqlens, width, n)
    y = torch.einsum("twc,cw->tc", source[y_rows].to(weight.dtype), weight).to(x.dtype)
    tail = lens.unsqueeze(1) + torch.arange(width - 1, device=x.device)        # [N, W-1]
    state_rows = _source_rows(torch.arange(n, device=x.device).unsqueeze(1), tail, cu_seqlens, width, n)
    return y, source[state_rows]


def _source_rows(seq: torch.Tensor, ext: torch.Tensor, cu_seqlens: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Row of `source` holding extended position ext of sequence seq."""
    from_state = seq * (width - 1) + ext
    from_tokens = n * (width - 1) + cu_seqlens[seq] + ext - (width - 1)
    return torch.where(ext < width - 1, from_state, from_tokens)
