"""The STANDALONE drafter: a smaller model of the family that shares the target's tokenizer, run autoregressively on
caches of its own.

The draft model's caches mirror the target's pools: its KDA state for a sequence lives in the sequence's state slot
and its latents in the sequence's pages (the same slot and page numbers, in the draft's own arrays), so the
scheduler's allocation covers both models. Before each step, for every sequence that may speculate, the drafter
first settles what the last verification decided (`Track`): the drafts the sequence's tokens confirm stay in its
cache, and its KDA state is rolled back to the one after the last confirmed token (kept before each draft was fed;
rejected positions' latents are overwritten later). It then computes the tokens the draft cache lacks (a prompt, a
prefix-cache hit, the target's last token) and feeds its own argmax back for up to `count` drafts, within the
pages the sequence holds. Drafts are deterministic, so verify.py's acceptance rule keeps the output distribution
the target's; a draft cache gone stale (a slot reused, a preemption) only costs acceptance, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...layers.batch import ForwardBatch
from ...layers.cache import HybridCache
from ...models.kimi import KimiForCausalLM
from ..cache.page_table import PageTable
from ..request import Sequence


@dataclass
class Track:
    """What the draft cache holds in one slot: positions [0, valid) of sequence `owner`, then the drafts `fed` at
    valid, valid + 1, ... (unconfirmed); kept[i] is the slot's KDA state (conv, recurrent per layer) before fed[i]."""

    owner: tuple[str, int]
    pages: list[int]                   # the sequence's pages when the draft cache last wrote them
    valid: int = 0
    fed: list[int] = field(default_factory=list)
    kept: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)


class StandaloneDrafter:
    """Drafts with a separate model whose caches mirror the target's slots and pages."""

    def __init__(self, draft: KimiForCausalLM, cache: HybridCache, page_table: PageTable, max_catch_up: int):
        self.model, self.cache, self.page_table = draft, cache, page_table
        self.device = draft.device
        self.max_catch_up = max_catch_up       # tokens one sequence's catch-up computes per step at most
        self.tracks: dict[int, Track] = {}     # slot -> its track

    @torch.inference_mode()
    def draft(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to count draft tokens for each (sequence, count) (none where the catch-up is not done or the
        sequence's pages end first)."""
        drafts: list[list[int]] = [[] for _ in wanted]
        todo = []
        for i, (seq, count) in enumerate(wanted):
            if count <= 0:
                continue
            track = self._settle(seq)
            n, capacity = seq.num_tokens, len(seq.pages) * self.cache.page_size
            end = min(n, capacity, track.valid + self.max_catch_up)
            if end > track.valid:
                todo.append((i, seq, track, end))
        if not todo:
            return drafts
        self.page_table.write_ahead()     # a fork's pages, a handed-over sequence's: recorded after the last step
        logits = self._forward([(seq.slot, t.valid, seq.tokens(t.valid, end)) for _, seq, t, end in todo])
        going = []
        for (i, seq, track, end), row in zip(todo, logits):
            track.valid = end
            if end == seq.num_tokens:         # caught up: its last logits predict the first draft
                drafts[i].append(int(row.argmax()))
                going.append((i, seq, track))
        while going := [(i, seq, t) for i, seq, t in going if len(drafts[i]) < wanted[i][1]
                        and t.valid + len(t.fed) < len(seq.pages) * self.cache.page_size]:
            for i, seq, track in going:
                track.kept.append([(s.conv[seq.slot].clone(), s.recurrent[seq.slot].clone()) for s in self.cache.kda])
                track.fed.append(drafts[i][-1])
            logits = self._forward([(seq.slot, t.valid + len(t.fed) - 1, [t.fed[-1]]) for _, seq, t in going])
            for (i, _, _), row in zip(going, logits):
                drafts[i].append(int(row.argmax()))
        return drafts

    def _settle(self, seq: Sequence) -> Track:
        """seq's track with the last verification applied: the confirmed drafts kept, the state rolled back to
        after the last of them (a fresh track if the slot held another sequence)."""
        owner = (seq.request.request_id, seq.index)
        track = self.tracks.get(seq.slot)
        if track is None or track.owner != owner or seq.pages[:len(track.pages)] != track.pages \
                or track.valid > seq.num_tokens:
            track = self.tracks[seq.slot] = Track(owner, list(seq.pages))
            return track
        track.pages = list(seq.pages)
        if track.fed:
            actual = seq.tokens(track.valid, min(track.valid + len(track.fed), seq.num_tokens))
            confirmed = next((j for j, (a, b) in enumerate(zip(actual, track.fed)) if a != b), len(actual))
            if confirmed < len(track.fed):
                for state, (conv, recurrent) in zip(self.cache.kda, track.kept[confirmed]):
                    state.conv[seq.slot] = conv
                    state.recurrent[seq.slot] = recurrent
            track.valid += confirmed
            track.fed, track.kept = [], []
        return track

    def _forward(self, parts: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """(slot, start, tokens) per sequence -> the draft's logits [N, vocab] at each one's last token (writing
        its caches)."""
        slots = torch.tensor([slot for slot, _, _ in parts], device=self.device)
        width = max(-(-(start + len(tokens)) // self.cache.page_size) for _, start, tokens in parts)
        batch = ForwardBatch.build([len(t) for _, _, t in parts], [s for _, s, _ in parts], slots,
                                   self.page_table.gather(slots, width), self.cache.page_size, self.device)
        hidden = self.model(torch.tensor([x for _, _, t in parts for x in t], device=self.device), batch, self.cache)
        return self.model.compute_logits(hidden[batch.cu_seqlens[1:] - 1])
