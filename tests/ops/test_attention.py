"""Masked attention against a written-out float64 softmax, and sparse attention against fla's naive DSA."""

from __future__ import annotations

import torch
from fla.ops.dsa.naive import naive_dsa, naive_dsa_indexer

from kestrel.ops import indexer_scores, masked_attention, topk_mask


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
