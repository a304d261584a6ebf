"""Counts of speculative decoding: drafts proposed and accepted, per verification and in all, and the time spent
drafting and verifying."""

from __future__ import annotations


class SpecStats:
    """accepted_histogram[j]: verifications that accepted j of their draft tokens (0..max_draft)."""

    def __init__(self, max_draft: int):
        self.verifications = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_histogram = [0] * (max_draft + 1)
        self.draft_seconds = self.verify_seconds = 0.0       # drafting (NGRAM lookups, MTP forwards); verify forwards

    def record(self, drafted: int, accepted: int) -> None:
        self.verifications += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.accepted_histogram[accepted] += 1

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verification (accepted drafts plus the target's own token); 0 before any."""
        return (self.accepted_tokens + self.verifications) / self.verifications if self.verifications else 0.0
