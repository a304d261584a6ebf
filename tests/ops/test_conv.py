"""The varlen short convolution against torch's own depthwise conv1d, run sequence by sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.ops import causal_conv1d
from kestrel.ops.torch.conv import causal_conv1d_windows

LENS = [5, 0, 1, 2, 17]
C, W = 6, 4


def reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: conv1d over [state; x] without padding; the new state is the last W-1 rows of [state; x]."""
    full = torch.cat([state, x])
    if len(x) == 0:
        return x, full[-(W - 1):]
    y = F.conv1d(full.t().unsqueeze(0), weight.unsqueeze(1), groups=C)[0].t()
    return y, full[-(W - 1):]


def test_matches_conv1d_per_sequence_with_and_without_state():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(LENS), C, generator=gen, dtype=torch.float64)
    weight = torch.randn(C, W, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    for state in (None, torch.randn(len(LENS), W - 1, C, generator=gen, dtype=torch.float64)):
        y, final = causal_conv1d(x, weight, cu, state)
        for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            s = torch.zeros(W - 1, C, dtype=torch.float64) if state is None else state[n]
            y_ref, final_ref = reference(x[a:b], weight, s)
            torch.testing.assert_close(y[a:b], y_ref)
            torch.testing.assert_close(final[n], final_ref)


def test_two_calls_equal_one():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, C, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    y, final = causal_conv1d(x, weight, torch.tensor([0, 11]))
    y1, s1 = causal_conv1d(x[:2], weight, torch.tensor([0, 2]))
    y2, s2 = causal_conv1d(x[2:], weight, torch.tensor([0, 9]), s1)
    torch.testing.assert_close(torch.cat([y1, y2]), y)
    torch.testing.assert_close(s2, final)


def test_one_token_per_sequence_matches_the_general_path():
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(3, C, generator=gen), torch.randn(C, W, generator=gen)
    state = torch.randn(3, W - 1, C, generator=gen)
    y, final = causal_conv1d(x, weight, torch.tensor([0, 1, 2, 3]), state)
    for n in range(3):
        y_ref, final_ref = reference(x[n:n + 1], weight, state[n])
        torch.testing.assert_close(y[n:n + 1], y_ref)
        torch.testing.assert_close(final[n], final_ref)


def test_window_sums_match_the_stream_convolution():
    """causal_conv1d_windows (kda_decode's form for uneven tokens per sequence) sums each window by one einsum:
    within W roundings (gamma_W sum |w x|) of causal_conv1d over float64, and the same final states exactly."""
    torch.manual_seed(3)
    x, weight, state = torch.randn(12, 10), torch.randn(10, 4), torch.randn(3, 3, 10)
    cu = torch.tensor([0, 1, 6, 12])
    y, final = causal_conv1d_windows(x, weight, cu, state)
    exact, exact_final = causal_conv1d(x.double(), weight.double(), cu, state.double())
    magnitude, _ = causal_conv1d(x.double().abs(), weight.double().abs(), cu, state.double().abs())
    assert ((y.double() - exact).abs() <= 4 * 2.0 ** -24 / (1 - 4 * 2.0 ** -24) * magnitude).all()
    assert torch.equal(final.double(), exact_final)
