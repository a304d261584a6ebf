"""Masked attention against a written-out float64 softmax, and sparse attention against fla's naive DSA; the
block-by-block indexer selection and the attention over listed keys against the whole-context formulation."""

from __future__ import annotations

import pytest
import torch
from fla.ops.dsa.naive import naive_dsa, naive_dsa_indexer

from kestrel.ops import indexer_scores, indexer_topk, masked_attention, sparse_attention, topk_mask
from kestrel.ops.torch import paged_attention
from kestrel.ops.torch.indexer import topk_positions
from helpers import selected_mask


def reference_attention(q, k, v, mask, scale):
    """float64 softmax attention written out: q [N, L, H, D], k/v [N, S, H or 1, D], mask [N, L, S]."""
    q, k, v = q.double(), k.double().expand(-1, -1, q.shape[2], -1), v.double().expand(-1, -1, q.shape[2], -1)
    scores = torch.einsum("nlhd,nshd->nhls", q, k) * scale
    weights = torch.softmax(scores.masked_fill(~mask.unsqueeze(1), float("-inf")), dim=-1)
    return torch.einsum("nhls,nshd->nlhd", weights, v).float()


def test_masked_attention_matches_the_written_out_softmax_for_shared_and_per_head_keys():
    gen = torch.Generator().manual_seed(0)
    n, l, s, h, d, dv = 2, 5, 9, 3, 8, 6
    q = torch.randn(n, l, h, d, generator=gen)
    mask = torch.rand(n, l, s, generator=gen) > 0.4
    mask[..., 0] = True
    for heads_k in (h, 1):
        k = torch.randn(n, s, heads_k, d, generator=gen)
        v = torch.randn(n, s, heads_k, dv, generator=gen)
        torch.testing.assert_close(masked_attention(q, k, v, mask, scale=0.3),
                                   reference_attention(q, k, v, mask, 0.3))


def test_query_rows_without_keys_give_zeros():
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)
    mask = torch.tensor([[[True, False, False], [False, False, False]]])
    out = masked_attention(q, k, v, mask, 0.5)
    assert torch.equal(out[0, 1], torch.zeros(1, 4)) and torch.allclose(out[0, 0, 0], v[0, 0, 0])


def causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril().unsqueeze(0)


def test_indexer_selection_and_sparse_attention_match_fla_naive_dsa():
    gen = torch.Generator().manual_seed(0)
    t, hi, di, h, d, topk = 40, 4, 16, 3, 8, 7
    q_idx = torch.randn(1, t, hi, di, generator=gen)
    k_idx = torch.randn(1, t, di, generator=gen)
    w_idx = torch.randn(1, t, hi, generator=gen)
    scores = indexer_scores(q_idx, k_idx, w_idx, causal(t))
    selected = topk_mask(scores, causal(t), topk)
    indices = naive_dsa_indexer(q_idx, k_idx, w_idx, topk=topk, activation="relu")[0]
    expected = torch.zeros(t, t + 1, dtype=torch.bool).scatter_(1, indices.masked_fill(indices < 0, t), True)[:, :t]
    assert torch.equal(selected[0], expected)

    q, k, v = torch.randn(1, t, h, d, generator=gen), torch.randn(1, t, h, d, generator=gen), torch.randn(
        1, t, h, d, generator=gen)
    got = masked_attention(q, k, v, selected, scale=d ** -0.5)
    torch.testing.assert_close(got, naive_dsa(q, k, v, None, None, indices=indices[None], topk=topk))


def test_topk_covering_the_context_is_dense_and_ties_go_to_earlier_positions():
    t = 6
    scores = torch.zeros(1, t, t).masked_fill(~causal(t), float("-inf"))
    assert torch.equal(topk_mask(scores, causal(t), t), causal(t))
    kept = topk_mask(scores, causal(t), 2)
    assert torch.equal(kept[0, -1], torch.tensor([True, True, False, False, False, False]))


def test_topk_mask_keeps_what_a_stable_descending_sort_keeps():
    """Scores drawn from 4 values (ties everywhere) and -inf where masked, against the definition: the first topk
    positions of a stable descending sort."""
    gen = torch.Generator().manual_seed(3)
    for t, topk in ((9, 1), (9, 4), (33, 8), (33, 32)):
        mask = torch.rand(2, t, t, generator=gen) < 0.7
        scores = torch.randint(0, 4, (2, t, t), generator=gen).float().masked_fill(~mask, float("-inf"))
        chosen = scores.sort(dim=-1, descending=True, stable=True).indices[..., :topk]
        expected = torch.zeros_like(mask).scatter_(-1, chosen, True) & mask
        assert torch.equal(topk_mask(scores, mask, topk), expected)


def tied_indexer_inputs(gen: torch.Generator, n: int, l: int, s: int, hi: int = 3, d: int = 8):
    """Index queries, keys and weights rounded to integers (many exactly equal scores), and each query's last
    visible position (-1: a padding row)."""
    q = torch.randn(n, l, hi, d, generator=gen).round()
    k = torch.randn(n, s, d, generator=gen).round()
    w = torch.randn(n, l, hi, generator=gen)
    last = torch.randint(-1, s, (n, l), generator=gen)
    return q, k, w, last


def test_blockwise_indexer_topk_equals_a_stable_sort_of_all_causal_scores():
    """Contexts well above topk, ties everywhere: the block-by-block selection (any block size) lists the first
    topk positions of a stable descending sort of the whole [N, L, S] scores, in that order, -1 past the allowed
    ones; and topk_positions over the whole scores lists the same."""
    gen = torch.Generator().manual_seed(5)
    n, l, s, topk = 2, 37, 300, 16
    q, k, w, last = tied_indexer_inputs(gen, n, l, s)
    mask = torch.arange(s) <= last.unsqueeze(-1)
    scores = indexer_scores(q, k, w, mask)
    tied_rows = ((scores == scores.topk(topk).values[..., -1:]).sum(-1) > 1) & (mask.sum(-1) > topk)
    assert tied_rows.sum() > 10                                          # ties at the cut are really tested
    ranked = scores.sort(dim=-1, descending=True, stable=True)
    expected = torch.where(ranked.values[..., :topk] > float("-inf"), ranked.indices[..., :topk], -1)
    assert torch.equal(topk_positions(scores, topk), expected)
    for block in (7, 16, 64, 299, 300, 4096):
        assert torch.equal(indexer_topk(q, k, w, last, topk, block=block), expected), block
    assert torch.equal(indexer_topk(q, k, w, last, s + 5, block=64), topk_positions(scores, s + 5))


def test_sparse_attention_equals_masked_attention_over_the_listed_keys():
    gen = torch.Generator().manual_seed(6)
    n, l, s, h, d, topk = 2, 9, 200, 3, 8, 12
    q_idx, k_idx, w_idx, last = tied_indexer_inputs(gen, n, l, s)
    last[0, 0] = -1                                                      # a query with no key
    selected = indexer_topk(q_idx, k_idx, w_idx, last, topk, block=32)
    mask = torch.arange(s) <= last.unsqueeze(-1)
    chosen = topk_mask(indexer_scores(q_idx, k_idx, w_idx, mask), mask, topk)
    q = torch.randn(n, l, h, d, generator=gen)
    for heads_k in (h, 1):
        k = torch.randn(n, s, heads_k, d, generator=gen)
        v = torch.randn(n, s, heads_k, 5, generator=gen)
        got = sparse_attention(q, k, v, selected, 0.3)
        torch.testing.assert_close(got, masked_attention(q, k, v, chosen, 0.3))
        torch.testing.assert_close(got, reference_attention(q, k, v, chosen, 0.3).nan_to_num())
        assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))


@pytest.mark.parametrize("sparse_rows", [paged_attention.SPARSE_ROWS, 16])
def test_sparse_paged_decode_reads_only_the_selected_rows(monkeypatch, sparse_rows, torch_paths):
    """paged_mla_decode's torch ops over selected positions equal the dense form masked to them, with every row they
    were not given set to NaN (so a read of any other row would show), at a context of 40 pages and top-16; the
    same when the tokens go by slices (SPARSE_ROWS rows at a time: one token each). (The CPU kernel's own test:
    test_paged_mla_kernel.)"""
    monkeypatch.setattr(paged_attention, "SPARSE_ROWS", sparse_rows)
    gen = torch.Generator().manual_seed(7)
    page_size, pages, width, value_dim, topk = 16, 40, 24, 16, 16
    cache = torch.randn((pages + 1) * page_size, width, generator=gen)
    table = (torch.randperm(pages, generator=gen) + 1).unsqueeze(0).repeat(2, 1)
    seq, pos = torch.tensor([0, 1]), torch.tensor([pages * page_size - 1, 300])
    scores = torch.randn(2, pages * page_size, generator=gen).round()             # ties
    scores = scores.masked_fill(torch.arange(pages * page_size) > pos.unsqueeze(1), float("-inf"))
    selected = topk_positions(scores, topk)
    q = torch.randn(2, 3, width, generator=gen)
    dense = paged_attention.paged_mla_decode(q, cache, None, table, page_size, seq, pos, 0.2, value_dim)
    rows = paged_attention.paged_rows(table, page_size, seq.unsqueeze(1), selected)
    only_selected = torch.full_like(cache, float("nan"))
    only_selected[rows] = cache[rows]
    sparse = paged_attention.paged_mla_decode(q, only_selected, None, table, page_size, seq, pos, 0.2, value_dim,
                                              selected)
    mask = selected_mask(selected, pages * page_size).unsqueeze(1)        # the former formulation
    context = cache[paged_attention.paged_rows(table, page_size, seq.unsqueeze(1),
                                               torch.arange(pages * page_size))].unsqueeze(2)
    expected = masked_attention(q.unsqueeze(1), context, context[..., :value_dim], mask, 0.2).squeeze(1)
    torch.testing.assert_close(sparse, expected)
    assert not torch.allclose(sparse, dense, atol=1e-3)
