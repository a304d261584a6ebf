"""MLA decode (dense and sparse) and the lightning indexer's scores over the paged cache: Triton kernels against
the torch references, under the Triton interpreter; and the references against the ops the layers use today.

The cache is written through `PagedRows.write` (fp32, fp16, or FP8 with a scale per row) into storage that starts
as NaN (an unwritten row must never reach a result), in pages handed out in shuffled order; contexts cover a single
token, exactly full pages and a partly filled last page; several queries of one sequence (speculative
verification) see different lengths, and groups of a sequence's consecutive tokens read its rows once. Tolerances,
relative to the largest reference magnitude: 1e-5 for fp32 and FP8 rows computed in fp32 (observed at most 2e-7),
2e-3 for fp16 (observed at most 3e-4: the kernel rounds the softmax weights to fp16 before the value product, as
flash attention does).
"""

from __future__ import annotations

import pytest
import torch

from kestrel.layers.cache import FP8, PagedRows
from kestrel.ops.torch import paged_attention as reference
from kestrel.ops.torch.indexer import topk_mask, topk_positions
from kestrel.ops.torch.paged_indexer import paged_indexer_scores as reference_scores
from kestrel.ops.triton.indexer import paged_indexer_scores
from kestrel.ops.triton.mla_decode import paged_mla_decode
from helpers import selected_mask

PAGE_SIZE = 16
CONTEXTS = [1, 48, 77, 150]                     # one token, three full pages, a partial page, several splits
QUERIES = [(0, 0), (1, 47), (2, 74), (2, 75), (2, 76), (3, 149)]   # (sequence, position); three drafts of seq 2
TOLERANCE = {torch.float32: 1e-5, FP8: 1e-5, torch.float16: 2e-3}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    finite = expected.isfinite()
    assert torch.equal(finite, actual.isfinite())
    scale = expected[finite].float().abs().max().clamp(min=1e-6)
    return float((actual[finite].float() - expected[finite].float()).abs().max() / scale)


def paged_cache(dim: int, cache_dtype: torch.dtype, generator: torch.Generator) -> tuple[PagedRows, torch.Tensor]:
    """Rows for CONTEXTS in shuffled pages (plus unused pages); returns the cache and a page table padded with 0."""
    pages_needed = [-(-length // PAGE_SIZE) for length in CONTEXTS]
    order = torch.randperm(sum(pages_needed) + 3, generator=generator) + 1          # page 0 stays unused
    width = max(pages_needed) + 2
    table = torch.zeros(len(CONTEXTS), width, dtype=torch.int64)
    used = 0
    for n, count in enumerate(pages_needed):
        table[n, :count] = order[used:used + count]
        used += count
    cache = PagedRows.allocate((int(order.max()) + 1) * PAGE_SIZE, dim, cache_dtype, "cpu")
    cache.values.fill_(float("nan"))
    if cache.scales is not None:
        cache.scales.fill_(float("nan"))
    for n, length in enumerate(CONTEXTS):
        positions = torch.arange(length)
        rows = table[n, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        cache.write(rows, torch.randn(length, dim, generator=generator))
    return cache, table


def queries() -> tuple[torch.Tensor, torch.Tensor]:
    seq, pos = zip(*QUERIES)
    return torch.tensor(seq), torch.tensor(pos)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, FP8])
@pytest.mark.parametrize("sparse", [False, True])
def test_mla_decode_matches_reference(cache_dtype: torch.dtype, sparse: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    heads, value_dim, row_width = 3, 32, 40               # padded to 16 heads and a 16-wide shared-key block
    cache, table = paged_cache(row_width, cache_dtype, generator)
    seq, pos = queries()
    dtype = torch.float32 if cache_dtype == FP8 else cache_dtype
    q = torch.randn(len(QUERIES), heads, row_width, generator=generator).to(dtype)
    selected = None
    if sparse:
        scores = torch.randn(len(QUERIES), max(CONTEXTS), generator=generator)
        scores = scores.masked_fill(torch.arange(max(CONTEXTS)) > pos.unsqueeze(1), float("-inf"))
        selected = topk_positions(scores, 24)[:, :20]        # fewer than 20 visible for the first query
        assert not selected.is_contiguous()                            # the top 20 of 24, as a strided view
    args = (q, cache.values, cache.scales, table, PAGE_SIZE, seq, pos, row_width ** -0.5, value_dim, selected)
    expected = reference.paged_mla_decode(*args)
    actual = paged_mla_decode(*args)
    assert actual.dtype == dtype and actual.shape == (len(QUERIES), heads, value_dim)
    assert relative_error(actual, expected) < TOLERANCE[cache_dtype]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, FP8])
def test_indexer_scores_match_reference(cache_dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    heads, dim = 4, 32
    cache, table = paged_cache(dim, cache_dtype, generator)
    seq, pos = queries()
    dtype = torch.float32 if cache_dtype == FP8 else cache_dtype
    q = torch.randn(len(QUERIES), heads, dim, generator=generator).to(dtype)
    weights = torch.randn(len(QUERIES), heads, generator=generator) * heads ** -0.5
    context_len = max(CONTEXTS) + 5                           # columns past every query's position are -inf
    args = (q, weights, cache.values, cache.scales, table, PAGE_SIZE, seq, pos, context_len)
    expected = reference_scores(*args)
    actual = paged_indexer_scores(*args)
    assert actual.shape == (len(QUERIES), context_len)
    assert relative_error(actual, expected) < TOLERANCE[cache_dtype]


GROUPS = [(1, 45), (2, 74), (3, 147)]
"""(sequence, first position) of three tokens each: a verification of two drafts per sequence, ending at the
context's last written row (the rows after the group's last token start as NaN)."""


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
@pytest.mark.parametrize("sparse", [False, True])
def test_grouped_queries_read_each_context_once_with_the_same_result(cache_dtype: torch.dtype, sparse: bool
                                                                     ) -> None:
    """Both references with tokens_per_seq=3 (each sequence's rows read once for its three tokens) equal the same
    queries taken one token at a time, and the Triton kernels take the grouping and agree."""
    generator = torch.Generator().manual_seed(4)
    width, heads, value_dim = 40, 2, 32
    cache, table = paged_cache(width, cache_dtype, generator)
    seq = torch.tensor([n for n, _ in GROUPS]).repeat_interleave(3)
    pos = torch.tensor([first for _, first in GROUPS]).repeat_interleave(3) + torch.arange(3).repeat(len(GROUPS))
    q = torch.randn(len(seq), heads, width, generator=generator)
    selected = None
    if sparse:
        scores = torch.randn(len(seq), max(CONTEXTS), generator=generator)
        selected = topk_positions(scores.masked_fill(torch.arange(max(CONTEXTS)) > pos.unsqueeze(1),
                                                               float("-inf")), 30)
    args = (q, cache.values, cache.scales, table, PAGE_SIZE, seq, pos, 0.2, value_dim, selected)
    one_by_one = reference.paged_mla_decode(*args)
    grouped = reference.paged_mla_decode(*args, tokens_per_seq=3)
    assert one_by_one.isfinite().all()
    torch.testing.assert_close(grouped, one_by_one, atol=1e-6, rtol=1e-6)
    assert relative_error(paged_mla_decode(*args, tokens_per_seq=3), one_by_one) < TOLERANCE[cache_dtype]

    weights = torch.randn(len(seq), heads, generator=generator)
    index_args = (q, weights, cache.values, cache.scales, table, PAGE_SIZE, seq, pos, max(CONTEXTS) + 5)
    one_by_one = reference_scores(*index_args)
    grouped = reference_scores(*index_args, tokens_per_seq=3)
    torch.testing.assert_close(grouped, one_by_one, atol=1e-6, rtol=1e-6)
    assert relative_error(paged_indexer_scores(*index_args, tokens_per_seq=3), one_by_one) < TOLERANCE[cache_dtype]


def test_topk_positions_select_what_topk_mask_selects() -> None:
    """The index form of the selection equals the mask form the layers use, ties (relu zeros) included."""
    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(5, 40, generator=generator).relu()             # many exact-zero ties
    visible = torch.arange(40) <= torch.tensor([3, 10, 25, 39, 39]).unsqueeze(1)
    scores = scores.masked_fill(~visible, float("-inf"))
    for topk in (8, 40, 64):
        expected = topk_mask(scores.unsqueeze(1), visible.unsqueeze(1), topk).squeeze(1)
        assert torch.equal(selected_mask(topk_positions(scores, topk), 40), expected)


def test_reference_matches_masked_attention_over_read_rows() -> None:
    """paged_mla_decode equals what GatedMLA._absorbed computes today: masked_attention over PagedRows.read,
    unwritten rows zeroed."""
    from kestrel.ops.torch.attention import masked_attention
    generator = torch.Generator().manual_seed(3)
    cache, table = paged_cache(40, FP8, generator)
    seq, pos = queries()
    q = torch.randn(len(QUERIES), 2, 40, generator=generator)
    visible = torch.arange(150) <= pos.unsqueeze(1)
    rows = reference.paged_rows(table, PAGE_SIZE, seq.unsqueeze(1), torch.arange(150))
    context = torch.where(visible.unsqueeze(-1), cache.read(rows, q.dtype), 0)
    expected = masked_attention(q.unsqueeze(1), context.unsqueeze(2), context[..., :32].unsqueeze(2),
                                visible.unsqueeze(1), 0.2)
    actual = reference.paged_mla_decode(q, cache.values, cache.scales, table, PAGE_SIZE, seq, pos, 0.2, 32)
    torch.testing.assert_close(actual, expected.squeeze(1), atol=1e-6, rtol=1e-6)   # bitwise on some CPUs only
