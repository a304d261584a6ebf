"""Speculative decoding in a run: the server's verification steps, drafted and accepted tokens and the mean
acceptance length (tokens emitted per verification), from /metrics (after minus before)."""

from __future__ import annotations

from .prefix import metric

COUNTERS = ("kestrel_spec_verifications", "kestrel_spec_draft_tokens", "kestrel_spec_accepted_tokens")


def speculative_report(before_metrics: str | None, after_metrics: str | None) -> dict | None:
    """None when the server's /metrics has no speculative-decoding counters (not kestrel, or an older one)."""
    before, after = ([metric(text, name) for name in COUNTERS] for text in (before_metrics, after_metrics))
    if None in before or None in after:
        return None
    steps, drafted, accepted = (int(a - b) for a, b in zip(after, before))
    return {"verifications": steps, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_length": (accepted + steps) / steps if steps else None}
