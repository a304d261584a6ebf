"""The device page table: rows by state slot, kept equal to every running sequence's pages by the scheduler through
admission, growth, forks and preemption."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.engine.cache.page_table import PageTable


def test_set_is_applied_at_flush_and_gather_returns_rows_by_slot():
    table = PageTable(num_slots=3, max_pages=4, fill=9, device="cpu")
    table.set(2, 0, [5, 1])
    assert (table.rows == 9).all()                                    # nothing written before the flush
    table.flush()
    table.set(2, 2, [7])
    table.set(0, 0, [3])
    table.flush()
    assert table.gather(torch.tensor([2, 0, 1]), 3).tolist() == [[5, 1, 7], [3, 9, 9], [9, 9, 9]]
    with pytest.raises(ValueError, match="slot 1 would hold 5 pages; the table has 4"):
        table.set(1, 3, [0, 0])


def test_rows_follow_every_running_sequence_through_forks_and_preemption(model_dir):
    """A tight KV pool (preemptions), n=3 requests (forks with a copied partial page) and chunked prefill: after
    every step each running sequence's row starts with exactly its pages."""
    llm = LLM(str(model_dir), page_size=4, max_total_tokens=96, chunked_prefill_size=8)
    engine = llm.engine
    gen = torch.Generator().manual_seed(7)
    for i, length in enumerate((9, 14, 6, 11)):
        prompt = torch.randint(3, 320, (length,), generator=gen).tolist()
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                          n=3 if i % 2 else 1))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.runner.page_table.flush()
        rows = engine.runner.page_table.rows
        for seq in engine.scheduler.running:
            assert rows[seq.slot, :len(seq.pages)].tolist() == seq.pages
            checked += 1
    assert checked > 50 and engine.scheduler.num_preemptions > 0
