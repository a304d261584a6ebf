"""Sampling against transformers' logits processors, float64 recomputation, and statistics of many draws."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kestrel.engine import sampling
from kestrel.engine.sampling import (
    SamplingParams,
    SamplingRow,
    apply_penalties,
    finite_rows,
    new_generator,
    raw_logprobs,
    sample,
    warp_logits,
)

V = 203   # not a multiple of any SIMD width, so row-wise kernels see ragged tails


def row(prompt=(), output=(), generator=None, eos=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator, eos)


def random_logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def random_ids(n: int, seed: int, vocab: int = V) -> list[int]:
    """n token ids drawn from a small part of the vocabulary, so that many repeat."""
    return torch.randint(0, vocab // 4, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row [1, V] through transformers' warpers in kestrel's order: temperature, min_p, top_k, top_p."""
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.min_p > 0:
        warpers.append(MinPLogitsWarper(p.min_p))
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(TopPLogitsWarper(p.top_p))
    ids = torch.zeros(1, 1, dtype=torch.int64)
    for warper in warpers:
        logits = warper(ids, logits)
    return logits


# --- logprobs, greedy, ranks -------------------------------------------------------------------------------

def test_raw_logprobs_is_fp32_log_softmax():
    logits = random_logits(3).double()
    lp = raw_logprobs(logits)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).float())


def test_greedy_is_argmax_with_raw_logprobs_and_top_alternatives():
    logits = random_logits(4)
    rows = [row(temperature=0, logprobs=n) for n in (5, 0, 1, 2)]
    out = sample(logits, rows)
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.ranks.dtype == torch.int64
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1).float())
    assert torch.equal(out.ranks, torch.ones(4, dtype=torch.int64))
    assert out.top_ids.shape == (4, 5) and out.top_logprobs.dtype == torch.float32
    order = ref.argsort(-1, descending=True)[:, :5]
    assert torch.equal(out.top_ids, order)
    torch.testing.assert_close(out.top_logprobs, ref.gather(1, order).float())


def test_logprobs_only_for_the_rows_that_ask():
    """Rows without `logprobs` get none computed (NaN, rank 0); the asking rows get what they get alone."""
    logits = random_logits(4, seed=3)
    rows = [row(temperature=0), row(temperature=0, logprobs=3), row(seed=1, generator=new_generator(1)),
            row(temperature=0, logprobs=0)]
    out = sample(logits, rows)
    assert out.logprobs[[0, 2]].isnan().all() and out.ranks[[0, 2]].tolist() == [0, 0]
    assert out.top_logprobs[[0, 2]].isnan().all()
    for i in (1, 3):
        alone = sample(logits[i:i + 1], [rows[i]])
        assert out.token_ids[i] == alone.token_ids[0] and out.ranks[i] == alone.ranks[0]
        assert out.logprobs[i] == alone.logprobs[0]
        n = rows[i].params.logprobs
        assert torch.equal(out.top_ids[i, :n], alone.top_ids[0, :n])


def test_no_logprobs_requested_gives_zero_columns_and_input_is_untouched():
    logits = random_logits(2)
    before = logits.clone()
    out = sample(logits, [row(), row(temperature=0)])
    assert out.top_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
    assert torch.equal(logits, before)


def test_ranks_are_under_raw_logprobs_after_penalties_move_the_choice():
    logits = random_logits(3, seed=1)
    best = logits.argmax(-1).tolist()
    rows = [row(output=[best[i]] * 3, temperature=0, frequency_penalty=2.0, logprobs=0) for i in range(3)]
    out = sample(logits, rows)
    assert all(t != b for t, b in zip(out.token_ids.tolist(), best))
    ref = torch.log_softmax(logits.double(), -1)
    chosen = ref.gather(1, out.token_ids[:, None])
    assert torch.equal(out.ranks, (ref > chosen).sum(-1) + 1)
    torch.testing.assert_close(out.logprobs, chosen.squeeze(1).float())


def test_rank_ties_count_against_the_chosen_token():
    """Greedy ties go to the lowest id; its rank counts every token with an equal or larger logprob."""
    logits = torch.tensor([[2.0, 2.0, 1.0, 0.0]])
    out = sample(logits, [row(temperature=0, logprobs=0)])
    assert out.token_ids.tolist() == [0] and out.ranks.tolist() == [2]


# --- penalties ----------------------------------------------------------------------------------------------

def test_repetition_penalty_matches_transformers():
    logits = random_logits(3, seed=2)
    rows = [row(prompt=random_ids(30, 10 + i), output=random_ids(12, 20 + i), repetition_penalty=rp)
            for i, rp in enumerate((1.3, 0.7, 2.5))]
    ours = apply_penalties(logits, rows)
    for i, r in enumerate(rows):
        ids = torch.tensor([list(r.prompt_ids) + list(r.output_ids)])
        theirs = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], theirs)


def test_all_penalties_match_a_float64_hand_computation():
    logits = random_logits(4, seed=3)
    settings = [dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3),
                dict(frequency_penalty=-0.4),
                dict(),
                dict(presence_penalty=1.5, repetition_penalty=0.8)]
    rows = [row(prompt=random_ids(20, 30 + i), output=random_ids(25, 40 + i), **s) for i, s in enumerate(settings)]
    ours = apply_penalties(logits, rows)
    for i, r in enumerate(rows):
        p = r.params
        expected = logits[i].double().tolist()
        counts = {t: list(r.output_ids).count(t) for t in set(r.output_ids)}
        for t in set(r.prompt_ids) | set(r.output_ids):
            expected[t] = expected[t] / p.repetition_penalty if expected[t] > 0 else expected[t] * p.repetition_penalty
        for t, c in counts.items():
            expected[t] -= p.frequency_penalty * c + p.presence_penalty
        torch.testing.assert_close(ours[i].double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[2], logits[2])


def test_greedy_applies_penalties_before_argmax():
    logits = random_logits(1, seed=4)
    prompt = logits[0].topk(3).indices.tolist()
    r = row(prompt=prompt, temperature=0, repetition_penalty=3.0)
    ids = torch.tensor([prompt])
    expected = RepetitionPenaltyLogitsProcessor(3.0)(ids, logits.clone()).argmax(-1)
    assert torch.equal(sample(logits, [r]).token_ids, expected)


def test_min_tokens_blocks_stop_tokens_and_eos_unless_ignored():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 4)
    rows = [row(output=[2], eos=[0], temperature=0, min_tokens=2),                    # eos blocked
            row(output=[2], eos=[0], temperature=0, min_tokens=2, stop_token_ids=[1]),  # eos and stop blocked
            row(output=[2], eos=[0], temperature=0, min_tokens=2, ignore_eos=True),
            row(output=[2, 2], eos=[0], temperature=0, min_tokens=2)]                 # min_tokens reached
    before = logits.clone()
    assert sample(logits, rows).token_ids.tolist() == [1, 2, 0, 0]
    assert torch.equal(logits, before)                            # the masks went on a copy


def test_token_bitmasks_constrain_their_rows_on_a_copy():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 2)
    rows = [row(temperature=0), row(temperature=0)]
    rows[1].token_bitmask = torch.tensor([1 << 2], dtype=torch.int32)          # only token 2 may come next
    before = logits.clone()
    assert sample(logits, rows).token_ids.tolist() == [0, 2]
    assert torch.equal(logits, before)


# --- temperature, min_p, top_k, top_p ---------------------------------------------------------------------------

WARP_SETTINGS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.5, min_p=0.05),
    dict(temperature=0.9, min_p=0.02, top_k=40, top_p=0.9),
    dict(temperature=2.0, top_k=3, top_p=0.5),
    dict(temperature=1.0, top_k=V + 10),
]


def assert_warps_like_transformers(logits: torch.Tensor, settings: list[dict]) -> None:
    """warp_logits over the batch keeps, row by row, the tokens transformers' warpers keep, with their values."""
    params = [SamplingParams(**s) for s in settings]
    ours = warp_logits(logits, params)
    for i, p in enumerate(params):
        theirs = hf_warp(logits[i:i + 1].clone(), p)
        kept = torch.isfinite(theirs)
        assert torch.equal(torch.isfinite(ours[i:i + 1]), kept), settings[i]
        torch.testing.assert_close(ours[i:i + 1][kept], theirs[kept])


def test_warping_matches_transformers_row_by_row_in_one_batch():
    for trial in range(5):
        assert_warps_like_transformers(random_logits(len(WARP_SETTINGS), seed=50 + trial), WARP_SETTINGS)


@pytest.mark.parametrize("candidates", [8, 16, 64])
def test_truncation_from_the_largest_logits_matches_transformers(monkeypatch, candidates):
    """top_k and top_p decided among a row's TOP_CANDIDATES largest logits keep what transformers keeps, for rows
    decided there (top_k within them, a nucleus inside them) and rows sorted whole (top_k past them, a nucleus
    reaching past them, a flat row)."""
    monkeypatch.setattr(sampling, "TOP_CANDIDATES", candidates)
    settings = [dict(top_k=5), dict(top_k=candidates - 1), dict(top_k=candidates), dict(top_k=candidates + 1),
                dict(top_k=V - 1), dict(top_p=0.9), dict(top_p=0.5), dict(top_p=0.99), dict(top_p=1e-9),
                dict(top_k=20, top_p=0.8), dict(top_k=3, top_p=0.5), dict(temperature=0.3, top_p=0.95)]
    for trial, scale in enumerate((3.0, 0.3, 8.0)):
        assert_warps_like_transformers(random_logits(len(settings), seed=90 + trial, scale=scale), settings)


def test_truncation_keeps_ties_with_the_kth_logit_outside_the_candidates(monkeypatch):
    """A k-th logit equal to the candidates' smallest may have ties outside them: that row is sorted whole."""
    monkeypatch.setattr(sampling, "TOP_CANDIDATES", 4)
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    kept = torch.isfinite(warp_logits(logits, [SamplingParams(top_k=4)]))
    assert kept.tolist() == [[True] * 6 + [False] * 2]
    kept = torch.isfinite(warp_logits(logits, [SamplingParams(top_k=3)]))
    assert kept.tolist() == [[True] * 3 + [False] * 5]


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    kept = torch.isfinite(warp_logits(logits, [SamplingParams(top_p=1e-9)]))
    assert kept.tolist() == [[True, False, False, False]]


def test_truncation_edges():
    """top_p stops at the first token whose mass reaches it exactly; min_p keeps a prob equal to its bar."""
    logits = torch.tensor([[4.0, 2.0, 1.0, 1.0]]).log()   # probs 1/2, 1/4, 1/8, 1/8: exact in fp32
    params = [SamplingParams(top_p=0.75), SamplingParams(top_p=0.5), SamplingParams(min_p=0.25),
              SamplingParams(top_k=3)]
    kept = torch.isfinite(warp_logits(logits.expand(4, -1), params)).tolist()
    assert kept == [[True, True, False, False], [True, False, False, False],
                    [True, True, True, True], [True, True, True, True]]   # top_k keeps ties at the k-th logit


# --- batching and seeds ------------------------------------------------------------------------------------------

MIXED = [
    dict(temperature=0, logprobs=3),
    dict(top_k=4, seed=11),
    dict(top_p=0.7, seed=12, logprobs=1),
    dict(temperature=0.8, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.2, seed=13),
    dict(seed=14, min_p=0.1, logprobs=6),
]


def mixed_rows(order: list[int]) -> list[SamplingRow]:
    rows = []
    for i in order:
        s = MIXED[i]
        generator = new_generator(s["seed"]) if "seed" in s else None
        rows.append(row(prompt=random_ids(15, 60 + i), output=random_ids(8, 70 + i), generator=generator, **s))
    return rows


def test_mixed_batch_gives_each_row_what_it_gives_alone():
    logits = random_logits(len(MIXED), seed=5, scale=1.5)
    order = [3, 0, 4, 1, 2]
    batched = mixed_rows(order)
    alone = [mixed_rows([i])[0] for i in order]
    for step in range(10):
        step_logits = logits[order] + step * 0.1
        out = sample(step_logits, batched)
        for pos, r in enumerate(alone):
            one = sample(step_logits[pos:pos + 1], [r])
            n = r.params.logprobs or 0
            assert out.token_ids[pos] == one.token_ids[0], (step, order[pos])
            assert out.ranks[pos] == one.ranks[0]
            torch.testing.assert_close(out.logprobs[pos], one.logprobs[0], rtol=0, atol=0, equal_nan=True)
            assert torch.equal(out.top_ids[pos, :n], one.top_ids[0, :n])
            assert torch.equal(out.top_logprobs[pos, :n], one.top_logprobs[0, :n])
        penalised = apply_penalties(step_logits, batched)
        warped = warp_logits(penalised[1:], [r.params for r in batched[1:]])   # every row but the greedy one
        for pos in range(1, len(order)):
            alone_warped = warp_logits(apply_penalties(step_logits[pos:pos + 1], [alone[pos]]), [alone[pos].params])
            assert torch.equal(warped[pos - 1:pos], alone_warped)


@pytest.mark.parametrize("block", [1024, 2, 3])
@pytest.mark.parametrize("u, token", [(0.0, 0), (0.4, 1), (0.5, 3), (0.6, 3), (1 - 2**-53, 3)])
def test_draw_never_lands_on_a_dropped_token(monkeypatch, block, u, token):
    """The inverse transform picks the first token whose cumulative mass exceeds u times the total, in one block or
    across several (a dropped token between kept ones, u * total exactly at a block's end, a padded last block); the
    largest uniform torch.rand gives still lands on the last kept token, never on the zero-probability ones after
    it."""
    monkeypatch.setattr(sampling, "DRAW_BLOCK", block)
    monkeypatch.setattr(torch, "rand", lambda n, **kwargs: torch.full((n,), u, dtype=torch.float64))
    probs = torch.tensor([[0.25, 0.25, 0.0, 0.5, 0.0, 0.0, 0.0]])
    assert sampling._draw(probs, [None]).tolist() == [token]


def test_seeded_rows_reproduce_across_calls_and_batch_positions():
    logits = torch.zeros(1, 1000)

    def run(seed: int, position: int, steps: int = 8) -> list[int]:
        generator = new_generator(seed)
        tokens = []
        for _ in range(steps):
            rows = [row() for _ in range(4)]
            rows.insert(position, row(seed=seed, generator=generator))
            torch.manual_seed(len(tokens))   # the default generator must not matter
            tokens.append(sample(logits.expand(5, -1), rows).token_ids[position].item())
        return tokens

    first = run(7, 0)
    assert run(7, 0) == first and run(7, 3) == first and run(7, 4) == first
    assert len(set(first)) > 1           # the generator advances from step to step
    assert run(8, 2) != first            # equal sequences of 8 uniform draws over 1000 tokens: p = 1e-24


def test_greedy_rows_consume_no_randomness():
    generator = new_generator(3)
    state, default_state = generator.get_state(), torch.get_rng_state()
    sample(random_logits(2), [row(temperature=0, generator=generator), row(temperature=1e-6)])
    assert torch.equal(generator.get_state(), state) and torch.equal(torch.get_rng_state(), default_state)


# --- statistics of many draws ------------------------------------------------------------------------------------

SMALL = torch.tensor([1.0, 0.5, 0.0, -0.3, -1.0, 0.2])


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


# 99.99th percentiles of the chi-square distribution with 5 and 1 degrees of freedom
CHI2_5DF, CHI2_1DF = 25.74, 15.14


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_frequencies_match_softmax(temperature):
    torch.manual_seed(0)
    draws = 40_000
    tokens = sample(SMALL.expand(draws, -1), [row(temperature=temperature)] * draws).token_ids
    assert chi_square(tokens, torch.softmax(SMALL / temperature, -1)) < CHI2_5DF


def test_draw_stays_on_the_kept_tokens_of_a_block_whose_sum_rounds_up(monkeypatch):
    """A block's float32 sum can round above its tokens' float64 cumulative mass; a u landing in between still
    draws a kept token of that block."""
    monkeypatch.setattr(sampling, "DRAW_BLOCK", 4)
    monkeypatch.setattr(torch, "rand", lambda n, **kwargs: torch.full((n,), 1 - 2**-53, dtype=torch.float64))
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.0]])                # float32 0.1 + 0.2 + 0.3 exceeds the float64 sum
    assert float(probs.sum()) > float(probs.double().cumsum(-1)[0, -1])
    assert sampling._draw(probs, [None]).tolist() == [2]


def test_frequencies_match_softmax_across_draw_blocks(monkeypatch):
    """The two-level draw (block, then token in it) with blocks smaller than the vocabulary, the last one padded."""
    monkeypatch.setattr(sampling, "DRAW_BLOCK", 4)
    torch.manual_seed(3)
    draws = 40_000
    tokens = sample(SMALL.expand(draws, -1), [row()] * draws).token_ids
    assert chi_square(tokens, torch.softmax(SMALL, -1)) < CHI2_5DF


def test_seeded_frequencies_match_softmax():
    draws = 4_000
    rows = [row(seed=s, generator=new_generator(s)) for s in range(draws)]
    tokens = sample(SMALL.expand(draws, -1), rows).token_ids
    assert chi_square(tokens, torch.softmax(SMALL, -1)) < CHI2_5DF


def test_top_k_draws_only_the_best_tokens_in_proportion():
    torch.manual_seed(1)
    draws = 20_000
    tokens = sample(SMALL.expand(draws, -1), [row(top_k=2)] * draws).token_ids
    assert set(tokens.tolist()) == {0, 1}
    assert chi_square(tokens, torch.softmax(SMALL[:2], -1)) < CHI2_1DF


def test_min_p_and_top_p_draw_only_allowed_tokens():
    torch.manual_seed(2)
    draws = 20_000
    probs = torch.softmax(SMALL, -1)
    allowed_min_p = set(torch.nonzero(probs >= 0.6 * probs.max()).flatten().tolist())
    tokens = sample(SMALL.expand(draws, -1), [row(min_p=0.6)] * draws).token_ids
    assert set(tokens.tolist()) == allowed_min_p
    nucleus = probs.argsort(descending=True)[:3].tolist()   # mass reaches 0.7 at the third token
    assert probs[nucleus[:2]].sum() < 0.7 <= probs[nucleus].sum()
    tokens = sample(SMALL.expand(draws, -1), [row(top_p=0.7)] * draws).token_ids
    assert set(tokens.tolist()) == set(nucleus)


# --- parameters -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5),
    ("temperature", -1), ("temperature", math.nan), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("seed", 1.5), ("seed", 2**64),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", 3),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("stop_token_ids", 2),
    ("ignore_eos", 1), ("skip_special_tokens", "yes"), ("include_stop_str_in_output", None),
    ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 17),
    ("logprobs", -1), ("prompt_logprobs", 1.0),
])
def test_bad_fields_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got .*\.$"):
        SamplingParams(**{field: value})


def test_normalisation_and_greedy():
    p = SamplingParams(stop="###", stop_token_ids=None, top_k=-1, temperature=0, max_tokens=None, min_tokens=50)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.top_k == 0
    assert p.greedy and isinstance(p.temperature, float)
    assert SamplingParams().stop == [] and not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(temperature=9e-6).greedy
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop == ["a", "b"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_rows_is_isfinite_all(dtype):
    """finite_rows flags a row exactly when isfinite().all(-1) does: one NaN, +inf or -inf anywhere in it (first,
    middle or last column; alone or together), and not the dtype's largest finite values."""
    logits = torch.randn(9, V, generator=torch.Generator().manual_seed(0)).to(dtype)
    big = torch.finfo(dtype).max
    logits[1, 0], logits[2, V // 2], logits[3, -1] = float("nan"), float("inf"), float("-inf")
    logits[4, 5], logits[4, 6] = float("inf"), float("-inf")
    logits[5, 7], logits[5, 8] = float("nan"), float("inf")
    logits[6, :] = big
    logits[7, 0], logits[7, 1] = big, -big
    assert finite_rows(logits).tolist() == torch.isfinite(logits).all(-1).tolist() == \
        [True, False, False, False, False, False, True, True, True]
    assert finite_rows(logits[:3].view(3, 1, V)).shape == (3, 1)
