"""Each state slot's KV pages as one row of a device tensor, written when pages are handed out, so that a step's
page table is a gather on the device instead of lists rebuilt on the host every step (at a 1M-token context and
64-token pages, 16,384 entries per sequence)."""

from __future__ import annotations

import torch


class PageTable:
    """rows [slots, max_pages] int64: row s lists, in order, the pages of the sequence holding state slot s.

    Columns past a sequence's pages hold `fill` or pages of an earlier holder of the slot; nothing reads them
    (attention masks every position past a sequence's end). The scheduler records each change with set() as it
    hands pages out; flush() applies the recorded changes with one host-to-device copy before a step reads rows.
    """

    def __init__(self, num_slots: int, max_pages: int, fill: int, device: torch.device | str):
        self.rows = torch.full((num_slots, max_pages), fill, dtype=torch.long, device=device)
        self._pending: list[int] = []          # (slot, column, page) triples, flattened

    @property
    def max_pages(self) -> int:
        return self.rows.shape[1]

    def set(self, slot: int, start: int, pages: list[int]) -> None:
        """Row `slot` holds `pages` from column `start` on (applied at the next flush)."""
        if start + len(pages) > self.max_pages:
            raise ValueError(f"slot {slot} would hold {start + len(pages)} pages; the table has {self.max_pages}.")
        for column, page in enumerate(pages, start):
            self._pending += (slot, column, page)

    def flush(self) -> None:
        """Write the changes recorded since the last flush."""
        self.apply(self.take())

    def write_ahead(self) -> None:
        """Write the changes recorded since the last flush now, keeping them recorded: the next take() still hands
        them to the other ranks (writing a change twice changes nothing)."""
        self.apply(self._pending)

    def take(self) -> list[int]:
        """The changes recorded since the last flush, as flattened (slot, column, page) triples, now cleared (a
        distributed engine sends them to the other ranks, which apply() them to their own tables)."""
        pending, self._pending = self._pending, []
        return pending

    def apply(self, pending: list[int]) -> None:
        """Write changes taken from a table with the same recorded history."""
        if pending:
            slot, column, page = torch.tensor(pending).view(-1, 3).t().to(self.rows.device)
            self.rows[slot, column] = page

    def gather(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """The first `width` columns of the rows of `slots` [N]: a contiguous page table [N, width]."""
        return self.rows[:, :width].index_select(0, slots)
