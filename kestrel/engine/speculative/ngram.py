"""SGLang's NGRAM drafter (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, for the longest n that occurred. No model and no state: agentic traffic (tool results quoted back,
code edited in place) repeats itself, and a repeat is drafted for free."""

from __future__ import annotations

MIN_MATCH, MAX_MATCH = 1, 4
"""Suffix lengths tried, longest first (SGLang's --speculative-ngram-min/max-match-window-size defaults)."""

WINDOW = 8192
"""How far back a match is looked for (tokens), so a step's lookup stays cheap at long contexts."""


def propose(tokens: list[int], count: int) -> list[int]:
    """Up to `count` draft tokens to follow tokens (its prompt and output so far); [] when no suffix recurs."""
    if count <= 0:
        return []
    recent = tokens[-WINDOW:]
    for n in range(min(MAX_MATCH, len(recent) - 1), MIN_MATCH - 1, -1):
        suffix = recent[-n:]
        for start in range(len(recent) - n - 1, -1, -1):
            if recent[start:start + n] == suffix:
                return recent[start + n:start + n + count]
    return []
