"""kestrel_cpu::indexer_topk, the lightning indexer's selection straight from the paged index-key cache (the CPU's
paged_indexer_topk): the positions a stable descending sort of the torch reference's scores lists first when those
scores are the batch-invariant products' (the kernel's summation order: equal bit for bit, ties included), for
float32, bfloat16 and FP8 keys, pages out of order, several sequences and tokens per sequence, tokens that see
nothing, decode tokens (a tile of one, scored in registers) at page sizes and dims off its vector width, and its
keys split across threads; against float64 scores, no unselected key beats a selected one by more
than float32 rounding; positions outside the cache are refused."""

from __future__ import annotations

import pytest
import torch

import kestrel.ops.cpu as cpu
from kestrel.layers.cache import FP8
from kestrel.ops import batch_invariant
from kestrel.ops.torch.indexer import topk_positions
from kestrel.ops.torch.paged_attention import paged_rows
from kestrel.ops.torch.paged_indexer import paged_indexer_scores, paged_indexer_topk


def paged_inputs(gen: torch.Generator, tokens_per_seq: list[int], context: int, heads: int, dim: int,
                 key_dtype: torch.dtype, query_dtype: torch.dtype, page_size: int = 16, integers: bool = False):
    """paged_indexer_scores' arguments: sequences whose pages lie out of order in a cache with spare pages, each with
    its tokens at the end of a context of `context` positions (a token before the first sees nothing: -1);
    integers: values rounded to integers, so that many scores tie exactly."""
    n, pages = len(tokens_per_seq), -(-context // page_size)
    table = torch.randperm(n * pages + 3, generator=gen)[:n * pages].view(n, pages)
    rows = (n * pages + 3) * page_size
    keys = torch.randn(rows, dim, generator=gen) * (12 if key_dtype == FP8 else 1)
    q = torch.randn(sum(tokens_per_seq), heads, dim, generator=gen)
    if integers:
        keys, q = keys.round(), q.round()
    scales = torch.rand(rows, generator=gen) * 0.1 + 0.01 if key_dtype == FP8 else None
    weights = torch.randn(q.shape[0], heads, generator=gen)
    seq = torch.repeat_interleave(torch.arange(n), torch.tensor(tokens_per_seq))
    positions = torch.cat([torch.arange(context - k, context) for k in tokens_per_seq])
    positions[0] = -1
    return (q.to(query_dtype), weights, keys.to(key_dtype), scales, table, page_size, seq, positions, context)


def reference(args: tuple, topk: int) -> torch.Tensor:
    """topk_positions of the torch reference's scores under the batch-invariant products."""
    with batch_invariant.invariant():
        return topk_positions(paged_indexer_scores(*args), topk)


CASES = [  # tokens per sequence, context, heads, dim, key dtype, query dtype, topk
    ([1, 1, 1], 300, 4, 32, torch.float32, torch.float32, 16),
    ([40, 3, 29], 700, 4, 32, torch.bfloat16, torch.bfloat16, 64),
    ([5, 5], 1000, 8, 64, FP8, torch.bfloat16, 32),
    ([7], 900, 2, 16, FP8, torch.float32, 50),
    ([3, 2], 2000, 4, 32, torch.float32, torch.bfloat16, 24),
    ([6], 40, 4, 32, torch.float32, torch.float32, 64),                 # every visible key selected, -1 after
]


@pytest.mark.parametrize("tokens, context, heads, dim, key_dtype, query_dtype, topk", CASES)
@pytest.mark.parametrize("integers", [False, True])
def test_the_kernel_selects_what_a_stable_sort_of_the_invariant_scores_selects(tokens, context, heads, dim, key_dtype,
                                                                               query_dtype, topk, integers):
    assert cpu.load()
    args = paged_inputs(torch.Generator().manual_seed(context + integers), tokens, context, heads, dim, key_dtype,
                        query_dtype, integers=integers)
    got = paged_indexer_topk(*args, topk)
    with batch_invariant.invariant():
        scores = paged_indexer_scores(*args)
    ranked = scores.sort(dim=-1, descending=True, stable=True)
    width = min(topk, context)
    expected = torch.where(ranked.values[..., :width] > float("-inf"), ranked.indices[..., :width], -1)
    assert got.shape == (len(args[0]), width) and torch.equal(got, expected)
    if integers and key_dtype != FP8:
        cut = scores.topk(width).values[:, -1:]
        assert ((scores == cut).sum(-1) > 1).sum() >= 1                     # ties at the cut are really tested
    if key_dtype != FP8:                # opcheck's schema test multiplies the inputs, which FP8 does not support
        torch.library.opcheck(torch.ops.kestrel_cpu.indexer_topk.default, (*args[:-1], width))


def test_keys_split_across_threads_select_the_same_positions() -> None:
    """One sequence's tokens with more threads than tiles: each thread scans a segment of the positions and the
    segments' candidates are merged."""
    assert cpu.load()
    args = paged_inputs(torch.Generator().manual_seed(1), [1, 2], 20000, 4, 32, torch.bfloat16, torch.bfloat16,
                        page_size=64)
    expected = reference(args, 64)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 4, 7):
            torch.set_num_threads(count)
            assert torch.equal(paged_indexer_topk(*args, 64), expected), count
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("page_size, dim, key_dtype, query_dtype", [
    (16, 32, torch.float32, torch.float32),      # whole groups of keys read in place
    (5, 24, torch.float32, torch.float32),       # groups across pages, a dim no multiple of the vector width
    (24, 48, torch.bfloat16, torch.float32),     # converted keys
    (16, 40, FP8, torch.float32),
    (16, 32, torch.float32, torch.bfloat16),     # keys rounded to the query's dtype
])
def test_decode_tokens_select_what_the_invariant_scores_select(page_size, dim, key_dtype, query_dtype) -> None:
    """Tokens alone in their tile (one per sequence, as in a decode step) take the one-token scan: the same
    selection, on one thread and with each token's keys split in two (4 threads for 3 tiles)."""
    assert cpu.load()
    args = paged_inputs(torch.Generator().manual_seed(page_size + dim), [1, 1, 1], 9001, 3, dim, key_dtype,
                        query_dtype, page_size=page_size, integers=True)
    expected = reference(args, 40)
    threads = torch.get_num_threads()
    try:
        for count in (1, 4):
            torch.set_num_threads(count)
            assert torch.equal(paged_indexer_topk(*args, 40), expected), count
    finally:
        torch.set_num_threads(threads)


def test_no_unselected_key_outscores_a_selected_one_beyond_rounding() -> None:
    """Against float64 scores: each token's selected keys are its top-k up to the float32 rounding of the scores
    (a dot product of D terms, then H weighted heads: at most (D + H + 2) units of 2^-24 of the sum of the terms'
    magnitudes)."""
    q, weights, keys, _, table, page_size, seq, positions, context = args = paged_inputs(
        torch.Generator().manual_seed(2), [4, 4], 3000, 4, 32, torch.float32, torch.float32)
    got = paged_indexer_topk(*args, 48)
    dim, heads = q.shape[-1], q.shape[1]
    rows = paged_rows(table, page_size, seq.unsqueeze(1), torch.arange(context))                  # [T, S]
    k = keys[rows].double()
    dots = torch.einsum("thd,tsd->ths", q.double(), k)
    scale = dim ** -0.5
    exact = (dots.relu() * scale * weights.double().unsqueeze(-1)).sum(1)
    magnitude = (torch.einsum("thd,tsd->ths", q.double().abs(), k.abs()) * scale
                 * weights.double().abs().unsqueeze(-1)).sum(1)
    bound = (dim + heads + 2) * 2.0 ** -24 * magnitude.amax(-1)
    visible = torch.arange(context) <= positions.unsqueeze(1)
    for t in range(q.shape[0]):
        chosen = got[t][got[t] >= 0]
        assert len(chosen) == min(48, int(visible[t].sum()))
        left = visible[t].clone()
        left[chosen] = False
        if left.any() and len(chosen):
            assert exact[t, chosen].min() >= exact[t, left].max() - 2 * bound[t]


def test_positions_outside_the_cache_are_refused() -> None:
    args = list(paged_inputs(torch.Generator().manual_seed(3), [2], 64, 4, 32, torch.float32, torch.float32))
    keys = args[2][:100]                                                   # pages past row 100 gone
    table = torch.full_like(args[4], 50)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.kestrel_cpu.indexer_topk(args[0], args[1], keys, None, table, 16, args[6], args[7], 8)
    with pytest.raises(RuntimeError, match="past the page table"):
        torch.ops.kestrel_cpu.indexer_topk(args[0], args[1], args[2], None, args[4], 16, args[6], args[7] + 64, 8)
