"""The flat batch every layer sees: N sequences' new tokens packed along one axis, plus where their caches live."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateCaptures:
    """KDA states saved partway through sequences' new tokens (the prefix cache's snapshot at a request's cache
    point, inside a chunk that runs past it): sequence seqs[i] of the batch saves its state after its first
    offsets[i] new tokens (0 < offsets[i] < its new tokens) into state slot slots[i]. The KDA layers then run the
    chunked recurrence over the head rows (every token before a capture, and all of the other sequences'), copy
    the captured states, and continue over the tail rows."""

    seqs: list[int]
    offsets: list[int]
    slots: list[int]
    firsts: list[int]                   # each captured sequence's first row among the batch's tokens
    head_rows: torch.Tensor             # [T_head] int64: the rows before the captures
    head_cu: torch.Tensor               # [N+1] int64: the head rows' cu_seqlens (captured sequences cut short)
    tail_rows: torch.Tensor             # [T - T_head] int64: the captured sequences' rows from their offsets on
    tail_cu: torch.Tensor               # [C+1] int64: the tail rows' cu_seqlens
    seq_index: torch.Tensor             # [C] int64: seqs
    slot_index: torch.Tensor            # [C] int64: slots

    @classmethod
    def build(cls, new_lens: list[int], captures: list[tuple[int, int, int]], device: torch.device | str
              ) -> StateCaptures:
        """captures: (sequence, offset, slot) triples, in sequence order."""
        seqs, offsets, slots = (list(c) for c in zip(*captures))
        if any(not 0 < r < new_lens[j] for j, r in zip(seqs, offsets)):
            raise ValueError("a capture must fall strictly inside its sequence's new tokens.")
        starts, cut = [0, *itertools.accumulate(new_lens)], dict(zip(seqs, offsets))
        in_tail = torch.zeros(starts[-1], dtype=torch.bool)
        for j, r in cut.items():
            in_tail[starts[j] + r:starts[j + 1]] = True

        def cu(lens: list[int]) -> torch.Tensor:
            return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.long, device=device)

        def rows(values: list[int] | torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.long, device=device)

        return cls(seqs, offsets, slots, [starts[j] for j in seqs], rows((~in_tail).nonzero()[:, 0]),
                   cu([cut.get(j, n) for j, n in enumerate(new_lens)]), rows(in_tail.nonzero()[:, 0]),
                   cu([new_lens[j] - r for j, r in zip(seqs, offsets)]), rows(seqs), rows(slots))


@dataclass(frozen=True)
class ForwardBatch:
    """Metadata of one forward call over N sequences (T new tokens in all).

    Sequence n contributes tokens cu_seqlens[n]:cu_seqlens[n+1]; before this call it already had prefix_lens[n]
    tokens in the caches. Without caches (training, a plain forward) every prefix length is 0.
    """

    cu_seqlens: torch.Tensor            # [N+1] int64
    prefix_lens: torch.Tensor           # [N] int64
    positions: torch.Tensor             # [T] int64, absolute position of each new token in its sequence
    seq_index: torch.Tensor             # [T] int64, which sequence each token belongs to
    offsets: torch.Tensor               # [T] int64, index of each token among its sequence's new tokens
    state_slots: torch.Tensor | None    # [N] int64, KDA state slot of each sequence
    page_table: torch.Tensor | None     # [N, max_pages] int64, KV pages of each sequence
    kv_write_index: torch.Tensor | None  # [T] int64, flat KV-cache row (page * page_size + offset) of each new token
    max_new: int                        # longest run of new tokens
    max_total: int                      # longest sequence after this call
    keep_token_states: bool = False     # speculative verification: KDA keeps every token's state, pools untouched
    uniform: bool = False               # every sequence brings max_new >= 1 tokens (known without reading lengths)
    dp_tokens: tuple[int, ...] | None = None  # DP attention: every DP group's new tokens; this batch is this rank's
                                              # group's, the model's stream holds all of them, group by group
    captures: StateCaptures | None = None     # KDA states saved partway through sequences' new tokens
    page_size: int = 0                  # tokens per KV page (with a page table)

    @classmethod
    def build(cls, new_lens: list[int], prefix_lens: list[int] | None = None,
              state_slots: list[int] | torch.Tensor | None = None,
              page_table: list[list[int]] | torch.Tensor | None = None, page_size: int = 0,
              device: torch.device | str = "cpu", keep_token_states: bool = False,
              captures: list[tuple[int, int, int]] = ()) -> ForwardBatch:
        """Build the metadata from per-sequence counts (new tokens, tokens already cached).

        page_table row n lists the KV pages (of page_size tokens) holding sequence n, in order. keep_token_states:
        a speculative verification (a few tokens per sequence, each with a cached prefix): see the field.
        captures: (sequence, offset, state slot) triples, see StateCaptures.
        """
        n = len(new_lens)
        prefix = prefix_lens if prefix_lens is not None else [0] * n
        if len(prefix) != n or any(x < 0 for x in new_lens) or any(x < 0 for x in prefix):
            raise ValueError("new_lens and prefix_lens must be non-negative and one per sequence.")
        lens = torch.tensor(new_lens, dtype=torch.long, device=device)
        prefix_t = torch.tensor(prefix, dtype=torch.long, device=device)
        cu = torch.zeros(n + 1, dtype=torch.long, device=device)
        cu[1:] = torch.cumsum(lens, 0)
        seq_index = torch.repeat_interleave(torch.arange(n, device=device), lens)
        offsets = torch.arange(int(cu[-1]), device=device) - cu[seq_index]
        positions = prefix_t[seq_index] + offsets
        max_total = max((a + b for a, b in zip(new_lens, prefix)), default=0)
        pages = _long(page_table, device)
        write_index = None
        if pages is not None:
            if page_size <= 0 or pages.dim() != 2 or pages.shape[0] != n:
                raise ValueError("page_table needs one row per sequence and a positive page_size.")
            needed = -(-max_total // page_size)
            if pages.shape[1] < needed:
                raise ValueError(f"page_table has {pages.shape[1]} pages per row; the longest sequence needs "
                                 f"{needed}.")
            write_index = kv_rows(pages, seq_index, positions, page_size)
        return cls(
            cu_seqlens=cu,
            prefix_lens=prefix_t,
            positions=positions,
            seq_index=seq_index,
            offsets=offsets,
            state_slots=_long(state_slots, device),
            page_table=pages,
            kv_write_index=write_index,
            max_new=max(new_lens, default=0),
            max_total=max_total,
            keep_token_states=keep_token_states,
            uniform=n > 0 and min(new_lens) == max(new_lens) > 0,
            captures=StateCaptures.build(new_lens, list(captures), device) if captures else None,
            page_size=page_size if pages is not None else 0,
        )

    @classmethod
    def for_decode(cls, prefix_lens: torch.Tensor, state_slots: torch.Tensor, page_table: torch.Tensor,
                   page_size: int, tokens_per_seq: int = 1) -> ForwardBatch:
        """tokens_per_seq new tokens per sequence (1: a decode step; more: a speculative verification, which keeps
        every token's KDA state), from device tensors with no host synchronisation (so a CUDA graph can capture
        it): prefix_lens [N], state_slots [N], page_table [N, W] int64.

        max_total is the table's capacity, W * page_size, an upper bound on every sequence's length; ops sized by
        it (the paged indexer's scores) mask the positions past each sequence's end.
        """
        n, device = prefix_lens.numel(), prefix_lens.device
        seq_index = torch.arange(n * tokens_per_seq, device=device) // tokens_per_seq
        offsets = torch.arange(n * tokens_per_seq, device=device) % tokens_per_seq
        positions = prefix_lens[seq_index] + offsets
        return cls(
            cu_seqlens=torch.arange(n + 1, device=device) * tokens_per_seq,
            prefix_lens=prefix_lens,
            positions=positions,
            seq_index=seq_index,
            offsets=offsets,
            state_slots=state_slots,
            page_table=page_table,
            kv_write_index=kv_rows(page_table, seq_index, positions, page_size),
            max_new=tokens_per_seq,
            max_total=page_table.shape[1] * page_size,
            keep_token_states=tokens_per_seq > 1,
            uniform=True,
            page_size=page_size,
        )

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.positions.numel()

    @property
    def stream_tokens(self) -> int:
        """Tokens of the residual stream: every DP group's under DP attention, else this batch's."""
        return self.num_tokens if self.dp_tokens is None else sum(self.dp_tokens)

    @functools.cached_property
    def kv_read_index(self) -> torch.Tensor | None:
        """[N, max_total] int64: the flat KV-cache row of every position of every sequence (0 past its end), made
        on first use: what attention over the gathered context reads (prefill chunks); a decode step reads the
        pages directly and never builds it (it grows with the context)."""
        if self.page_table is None:
            return None
        n, device = self.num_seqs, self.page_table.device
        every = torch.arange(self.max_total, device=device).expand(n, self.max_total)
        rows = torch.arange(n, device=device).unsqueeze(1).expand(n, self.max_total)
        return torch.where(every < self.seq_lens.unsqueeze(1), kv_rows(self.page_table, rows, every, self.page_size), 0)

    @property
    def seq_lens(self) -> torch.Tensor:
        """[N] tokens of each sequence after this call."""
        return self.prefix_lens + self.cu_seqlens.diff()

    @property
    def has_prefix(self) -> bool:
        return bool((self.prefix_lens > 0).any())

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> [N, max_new, ...], zeros after each sequence's end."""
        out = x.new_zeros(self.num_seqs * self.max_new, *x.shape[1:]).index_copy(0, self._padded_rows(), x)
        return out.unflatten(0, (self.num_seqs, self.max_new))

    def from_padded(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, max_new, ...] -> [T, ...]."""
        return x.flatten(0, 1).index_select(0, self._padded_rows())

    def _padded_rows(self) -> torch.Tensor:
        """[T] int64: each new token's row in the flattened [N * max_new] padded layout. (index_copy and
        index_select, unlike advanced indexing, have cheap backward passes on the CPU.)"""
        return self.seq_index * self.max_new + self.offsets


def kv_rows(pages: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat cache row of position pos of sequence seq: its page's first row plus the offset in the page."""
    cols = (pos // page_size).clamp(max=pages.shape[1] - 1)
    return pages[seq, cols] * page_size + pos % page_size


def _long(value, device) -> torch.Tensor | None:
    if value is None:
        return None
    return torch.as_tensor(value, dtype=torch.long, device=device)
