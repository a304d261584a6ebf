"""Measurements of the bundled model on held-out text: perplexity, MTP top-1 accuracy, and how much of the dense
attention the lightning indexer's selection recovers. Also the hooks that training uses to read the indexer.

Protocol (the model card and tests/models/test_bundled.py use the same): a text is cut into windows of `seq_len`
tokens, each after [BOS] (tiny_data.eval_windows). Perplexity is exp of the mean next-token cross-entropy over
every token of every window, with the indexer's top-k selection active as when serving. MTP top-1 accuracy is the
share of positions t whose draft (from the hidden state at t and token t+1) predicts token t+2. Attention mass
recovered: with dense attention, the share of each query's head-averaged attention that falls on the indexer's
top-k keys, averaged over the queries that have more than top-k keys to choose from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kestrel import ops
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.mla import GatedMLA
from kestrel.models.kimi import KimiForCausalLM

DENSE = 1 << 30
"""An indexer top-k larger than any sequence: selection keeps everything, attention is dense."""


def indexed_layers(model: KimiForCausalLM) -> list[GatedMLA]:
    """The MLA layers that have a lightning indexer (the MTP layer's MLA has none)."""
    return [m for m in model.modules() if isinstance(m, GatedMLA) and m.indexer is not None]


@dataclass
class AttentionRecord:
    """What one indexed MLA layer saw in a forward call: index scores [N, L, S] (-inf where causally masked) and
    the heads' mean attention distribution [N, L, S] over the keys it attended."""

    scores: torch.Tensor
    attention: torch.Tensor


@contextmanager
def record_attention(model: KimiForCausalLM) -> Iterator[list[list[AttentionRecord]]]:
    """Within the block, every forward call of an indexed layer appends its AttentionRecord to that layer's list."""
    layers = indexed_layers(model)
    records: list[list[AttentionRecord]] = [[] for _ in layers]
    handles = []
    for layer, out in zip(layers, records):
        pending: dict[str, list] = {}

        def inject(module, args, kwargs, pending=pending):
            pending["scores"], pending["attention"] = [], []
            return args, dict(kwargs, index_scores_out=pending["scores"], attention_out=pending["attention"])

        def collect(module, args, output, out=out, pending=pending):
            out.append(AttentionRecord(pending["scores"][0], pending["attention"][0]))

        handles.append(layer.register_forward_pre_hook(inject, with_kwargs=True))
        handles.append(layer.register_forward_hook(collect))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def indexer_topk(model: KimiForCausalLM, topk: int) -> Iterator[None]:
    """Within the block, every indexer keeps `topk` keys (DENSE: all of them)."""
    indexers = [layer.indexer for layer in indexed_layers(model)]
    saved = [i.topk for i in indexers]
    for i in indexers:
        i.topk = topk
    try:
        yield
    finally:
        for i, k in zip(indexers, saved):
            i.topk = k


def recovered_mass(record: AttentionRecord, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query with more than topk keys: the dense attention mass on the indexer's top-k keys and on the topk
    most recent keys (a sliding window, for comparison). Two [Q] fp32 tensors."""
    allowed = torch.isfinite(record.scores)
    rows = allowed.sum(-1) > topk
    selected = ops.topk_mask(record.scores, allowed, topk)
    positions = torch.arange(allowed.shape[-1])
    last = allowed.sum(-1, keepdim=True) - 1
    recent = allowed & (positions > last - topk)
    return (record.attention * selected).sum(-1)[rows], (record.attention * recent).sum(-1)[rows]


@torch.no_grad()
def evaluate(model: KimiForCausalLM, windows: list[torch.Tensor], batch_size: int = 16) -> dict:
    """Perplexity, MTP top-1 accuracy and indexer attention-mass recovery of `model` on `windows` (see module)."""
    nll = hits = tokens = drafts = 0.0
    mass: list[list[torch.Tensor]] = [[] for _ in indexed_layers(model)]
    window_mass: list[list[torch.Tensor]] = [[] for _ in indexed_layers(model)]
    topk = indexed_layers(model)[0].indexer.topk
    for start in range(0, len(windows), batch_size):
        group = windows[start:start + batch_size]
        loss, correct, count = _lm_and_mtp(model, group)
        nll, hits, tokens, drafts = nll + loss, hits + correct, tokens + sum(len(w) - 1 for w in group), drafts + count
        with indexer_topk(model, DENSE), record_attention(model) as records:
            _forward(model, group)
        for layer, layer_records in enumerate(records):
            got, recent = recovered_mass(layer_records[0], topk)
            mass[layer].append(got)
            window_mass[layer].append(recent)
    per_layer = [torch.cat(m).mean().item() for m in mass]
    return {
        "loss": nll / tokens, "perplexity": math.exp(nll / tokens), "tokens": int(tokens),
        "mtp_top1": hits / drafts, "mtp_positions": int(drafts),
        "indexer_mass_per_layer": per_layer, "indexer_mass": sum(per_layer) / len(per_layer),
        "recent_window_mass": sum(torch.cat(m).mean().item() for m in window_mass) / len(window_mass),
    }


@torch.no_grad()
def heldout_loss(model: KimiForCausalLM, windows: list[torch.Tensor], batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over every token of the windows."""
    nll = tokens = 0.0
    for start in range(0, len(windows), batch_size):
        group = windows[start:start + batch_size]
        hidden, _ = _forward(model, group)
        targets = torch.cat([w[1:] for w in group])
        nll += F.cross_entropy(model.compute_logits(hidden), targets, reduction="sum").item()
        tokens += len(targets)
    return nll / tokens


def _forward(model: KimiForCausalLM, windows: list[torch.Tensor]) -> tuple[torch.Tensor, ForwardBatch]:
    """Hidden states [T, D] of every window but its last token, packed."""
    batch = ForwardBatch.build([len(w) - 1 for w in windows])
    return model(torch.cat([w[:-1] for w in windows]), batch), batch


def _lm_and_mtp(model: KimiForCausalLM, windows: list[torch.Tensor]) -> tuple[float, int, int]:
    """(summed next-token NLL, MTP top-1 hits, MTP positions) over the windows."""
    hidden, batch = _forward(model, windows)
    targets = torch.cat([w[1:] for w in windows])
    nll = F.cross_entropy(model.compute_logits(hidden), targets, reduction="sum").item()
    keep = torch.cat([torch.arange(len(w) - 1) < len(w) - 2 for w in windows])
    drafts = [w for w in windows if len(w) > 2]
    mtp_batch = ForwardBatch.build([len(w) - 2 for w in drafts])
    draft = model.mtp_logits(hidden[keep], torch.cat([w[1:-1] for w in drafts]), mtp_batch).argmax(-1)
    correct = (draft == torch.cat([w[2:] for w in drafts])).sum().item()
    return nll, int(correct), int(keep.sum())
