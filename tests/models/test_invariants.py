"""Invariants of the forward API for each family member: the cached, batched and chunked paths all equal the
plain full forward of each sequence alone."""

from __future__ import annotations

import pytest
import torch

from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.layers.mla import ABSORBED, PLAIN, GatedMLA
from kestrel.ops import backend
from helpers import tiny_model

LENGTHS = [1, 7, 40, 70]   # 70 spans two KDA chunks
ATOL = 1e-4                # fp32 accumulation-order noise; logits are O(1)


def random_sequences(lengths: list[int], vocab: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


@torch.no_grad()
def logits_alone(model, seq: torch.Tensor) -> torch.Tensor:
    """Full forward of one sequence without caches: logits [L, vocab]."""
    return model.compute_logits(model(seq, ForwardBatch.build([len(seq)])))


class Runner:
    """Drives a model over a HybridCache whose slots and pages are deliberately out of order."""

    def __init__(self, model, num_seqs: int, max_len: int, page_size: int = 4):
        self.model = model
        pages = -(-max_len // page_size)
        self.cache = HybridCache.allocate(model.config, num_slots=num_seqs + 2, num_pages=num_seqs * pages + 3,
                                          page_size=page_size, dtype=torch.float32)
        for state in self.cache.kda:   # garbage (even NaN) in free slots must not leak into new sequences
            state.recurrent.fill_(float("nan"))
            state.conv.fill_(float("nan"))
        for layer in self.cache.mla:   # nor in rows no sequence has written
            for paged in (layer.latent, layer.index_keys):
                if paged is not None:
                    paged.values.fill_(float("nan"))
        perm = torch.randperm(num_seqs * pages + 3, generator=torch.Generator().manual_seed(0))
        self.page_table = perm[: num_seqs * pages].view(num_seqs, pages)
        self.slots = list(range(num_seqs + 1, 0, -1))[:num_seqs]
        self.page_size = page_size

    @torch.no_grad()
    def step(self, seq_ids: list[int], chunks: list[torch.Tensor], prefix: list[int],
             captures: list[tuple[int, int, int]] = ()) -> list[torch.Tensor]:
        batch = ForwardBatch.build([len(c) for c in chunks], prefix, [self.slots[i] for i in seq_ids],
                                   self.page_table[seq_ids], self.page_size, captures=captures)
        self.last = batch
        logits = self.model.compute_logits(self.model(torch.cat(chunks), batch, self.cache))
        return list(logits.split([len(c) for c in chunks]))


def test_mixed_length_batch_equals_each_alone(family_model):
    model, _ = family_model
    seqs = random_sequences(LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        batched = model.compute_logits(model(torch.cat(seqs), ForwardBatch.build(LENGTHS)))
    for seq, got in zip(seqs, batched.split(LENGTHS)):
        torch.testing.assert_close(got, logits_alone(model, seq), atol=ATOL, rtol=0)


def test_prefill_then_decode_equals_full_forward(family_model):
    """... and a decode step reads the pages directly: it never builds the context-wide kv_read_index (which the
    prefill's attention over the gathered context reads, unless every MLA layer is sparse past its top-k: those read
    the pages too)."""
    model, _ = family_model
    seqs = random_sequences(LENGTHS, model.config.vocab_size)
    prompt = [1, 3, 33, 66]
    runner = Runner(model, len(seqs), max(LENGTHS))
    got = runner.step(list(range(len(seqs))), [s[:p] for s, p in zip(seqs, prompt)], [0] * len(seqs))
    layers = model.model.layers[:model.config.num_hidden_layers]          # not the MTP layer
    gathers = any(m.indexer is None or m.indexer.topk >= max(prompt) for m in layers.modules()
                  if isinstance(m, GatedMLA))
    assert ("kv_read_index" in vars(runner.last)) == gathers
    outputs = [[g] for g in got]
    for pos in range(1, max(LENGTHS)):
        live = [i for i, s in enumerate(seqs) if prompt[i] <= pos < len(s)]
        if live:
            for i, g in zip(live, runner.step(live, [seqs[i][pos:pos + 1] for i in live], [pos] * len(live))):
                outputs[i].append(g)
            assert "kv_read_index" not in vars(runner.last)
    for seq, parts in zip(seqs, outputs):
        torch.testing.assert_close(torch.cat(parts), logits_alone(model, seq), atol=ATOL, rtol=0)


def test_chunked_prefill_equals_unchunked(family_model):
    model, _ = family_model
    seqs = random_sequences([70, 45], model.config.vocab_size)
    cuts = [[0, 13, 53, 70], [0, 1, 45, 45]]      # uneven chunks, one of them empty
    runner = Runner(model, 2, 70)
    outputs: list[list[torch.Tensor]] = [[], []]
    for step in range(3):
        chunks = [s[c[step]:c[step + 1]] for s, c in zip(seqs, cuts)]
        for i, g in enumerate(runner.step([0, 1], chunks, [c[step] for c in cuts])):
            outputs[i].append(g)
    for seq, parts in zip(seqs, outputs):
        torch.testing.assert_close(torch.cat(parts), logits_alone(model, seq), atol=ATOL, rtol=0)


@pytest.mark.parametrize("form", [PLAIN, ABSORBED])
def test_mla_forms_agree_on_cached_prefill(family_model, form):
    """The plain (expanded) and absorbed (latent) MLA forms give the same logits, prefill over a cached prefix."""
    model, _ = family_model
    seq = random_sequences([50], model.config.vocab_size)[0]
    for module in model.modules():
        if isinstance(module, GatedMLA):
            module.form = form
    runner = Runner(model, 1, 50)
    parts = runner.step([0], [seq[:20]], [0]) + runner.step([0], [seq[20:]], [20])
    torch.testing.assert_close(torch.cat(parts), logits_alone(model, seq), atol=ATOL, rtol=0)


def test_sequence_without_prefix_ignores_stale_slot_contents(family_model):
    """A reused slot's old state must not leak: the Runner fills free slots with noise, this reuses a used one."""
    model, _ = family_model
    a, b = random_sequences([30, 30], model.config.vocab_size)
    runner = Runner(model, 2, 30)
    runner.step([0], [a], [0])
    runner.slots[1] = runner.slots[0]             # b takes a's slot, full of a's state
    got = runner.step([1], [b], [0])[0]
    torch.testing.assert_close(got, logits_alone(model, b), atol=ATOL, rtol=0)


def test_a_captured_state_equals_a_prefill_that_stops_there(family_model):
    """A chunk that saves its KDA state partway (the prefix cache's capture at a request's cache point, into a slot
    of its own) leaves there exactly the state of a prefill that stops at that point: past a KDA chunk boundary
    (66 of 70), and 2 tokens into a chunk that continues a cached prefix (its conv state partly from before); its
    logits stay those of each sequence alone."""
    check_captures(family_model[0])


def test_a_captured_state_on_the_triton_kernels():
    """The same with the KDA family's Triton kernels (under the interpreter)."""
    backend.set_backend("triton", "kda")
    try:
        check_captures(tiny_model("k3.1-tiny")[0], long=12)
    finally:
        backend.set_backend(None, "kda")


def check_captures(model, long: int = 70) -> None:
    """Captures after long - 4 of a fresh sequence's long tokens and 2 of another's after a prefix of 10."""
    a, b, c = random_sequences([long, 15, 7], model.config.vocab_size)
    runner, heads = Runner(model, 3, max(long, 15)), Runner(model, 3, max(long, 15))
    for r in (runner, heads):
        r.step([1], [b[:10]], [0])
    spare = [0, 1]                     # the slots no sequence of the Runner holds
    got = runner.step([0, 1, 2], [a, b[10:], c], [0, 10, 0], captures=[(0, long - 4, spare[0]), (1, 2, spare[1])])
    heads.step([0, 1], [a[:long - 4], b[10:12]], [0, 10])
    for state, head in zip(runner.cache.kda, heads.cache.kda):
        for name in ("conv", "recurrent"):      # the batches differ, so later layers' inputs differ by rounding
            torch.testing.assert_close(getattr(state, name)[spare], getattr(head, name)[heads.slots[:2]],
                                       atol=1e-5, rtol=0)
    for seq, logits in zip([a, b, c], got):
        torch.testing.assert_close(logits, logits_alone(model, seq)[-len(logits):], atol=ATOL, rtol=0)
