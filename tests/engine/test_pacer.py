"""PrefillPacer: the prompt tokens of a step while sequences decode, from a linear cost model fitted to recent
steps (oracle: the model's closed-form solution for costs drawn exactly from a known line); and the schedulers'
prompt_limit: while set, a step's prompt tokens (running prompts' chunks and admissions) stay within it, decode
tokens do not count, and every prompt still moves."""

from __future__ import annotations

import pytest

from kestrel.engine.dp_scheduler import DPScheduler
from kestrel.engine.pacer import MIN_PROMPT_TOKENS, WINDOW, PrefillPacer
from test_dp_scheduler import group, sequence

FIXED, PER_SEQUENCE, PER_TOKEN = 0.040, 0.006, 0.0029
"""The 437M K3's step costs on 2 cores, roughly (seconds)."""


def cost(decoding: int, prompt_tokens: int) -> float:
    return FIXED + PER_SEQUENCE * decoding + PER_TOKEN * prompt_tokens


def test_the_limit_fills_the_stall_after_the_decode_cost_of_the_fitted_model():
    pacer = PrefillPacer(stall_s=1.0)
    assert pacer.limit(4) is None                          # nothing measured: no bound
    for decoding, prompt in [(0, 128), (1, 384), (3, 155), (8, 129), (20, 62)]:
        pacer.observe(decoding, prompt, cost(decoding, prompt))
    for decoding in (1, 8, 32):
        pacer.observe(decoding, 0, cost(decoding, 0))
    for decoding in (1, 8, 32, 100, 160, 500):
        decode = FIXED + PER_SEQUENCE * decoding
        expected = max(1.0 - decode, decode) / PER_TOKEN   # past half the stall, as long as the decode tokens take
        assert pacer.limit(decoding) in (int(expected) - 1, int(expected))    # float64 least squares, rounding
    slow = PrefillPacer(stall_s=1.0)
    slow.observe(0, 1, 100.0)           # one token in 100 s (least norm: 50 s fixed, 50 s a token): 1 token fits
    assert slow.limit(0) == MIN_PROMPT_TOKENS


def test_only_the_last_steps_count_and_zero_turns_the_bound_off():
    pacer = PrefillPacer(stall_s=1.0)
    for _ in range(WINDOW):
        pacer.observe(4, 100, 10.0)                        # a slow machine once (another process, say)
    for decoding in range(WINDOW):
        pacer.observe(decoding % 8, 50 + decoding, cost(decoding % 8, 50 + decoding))
        pacer.observe(decoding % 8, 0, cost(decoding % 8, 0))
    expected = (1.0 - FIXED - 2 * PER_SEQUENCE) / PER_TOKEN     # the slow steps gone from the fit
    assert pacer.limit(2) in (int(expected) - 1, int(expected))
    off = PrefillPacer(stall_s=0.0)
    off.observe(1, 100, 1.0)
    assert off.limit(1) is None


def test_a_fit_without_a_positive_token_cost_takes_the_slowest_token_seen():
    """Noise: the step with more prompt tokens ran faster. The fitted line has a negative slope; the bound takes
    the slowest seconds per prompt token measured instead (0.01 s), after the fitted fixed cost (1.5 s)."""
    pacer = PrefillPacer(stall_s=3.0)
    pacer.observe(0, 100, 1.0)
    pacer.observe(0, 200, 0.5)
    assert pacer.limit(0) in (149, 150)                  # float64 least squares, rounded down


@pytest.mark.parametrize("limit", [1, 5, 12, None])
def test_prompt_limit_caps_prompt_chunks_and_admissions_not_decode_tokens(limit):
    scheduler = group()                                   # chunks of 16, 64 tokens per step, 8 pages of 4
    a, b = sequence("a", 3), sequence("b", 20)
    scheduler.add(a)
    [first] = scheduler.schedule()                        # (the engine sets a limit only while sequences decode)
    assert first.length == 3 and scheduler.decoding() == 0
    a.num_computed += first.length
    a.output_ids.append(7)
    assert scheduler.decoding() == 1 and not scheduler.prefilling()
    scheduler.add(b)
    assert scheduler.prefilling()
    steps, most = 0, min(limit or 64, 16)
    while b.num_computed < b.num_tokens:
        chunks = scheduler.schedule(limit)
        assert [c.seq for c in chunks if c.decodes] == [a]           # a decodes every step, whatever the limit
        assert [c.length for c in chunks if not c.decodes] == [min(most, b.num_tokens - b.num_computed)]
        b.num_computed += chunks[-1].length
        steps += 1
        assert scheduler.prefilling() == (b.num_computed < b.num_tokens - 1)
    assert steps == -(-b.num_tokens // most) and scheduler.decoding() == 1


def test_dp_groups_share_the_prompt_limit():
    dp = DPScheduler([group(), group()])
    seqs = [sequence(name, 12) for name in "abcd"]
    for seq in seqs:
        dp.add(seq)
    chunks = dp.schedule(10)
    by_group = [sum(c.length for c in chunks if c.seq.dp_group == g) for g in (0, 1)]
    assert by_group == [5, 5]
