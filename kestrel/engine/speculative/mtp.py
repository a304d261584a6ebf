"""The NEXTN / MTP drafter: the model's own multi-token-prediction layer, chained for several draft tokens.

The MTP layer at position t reads the main model's hidden state h_t and the embedding of token t+1 and predicts
token t+2; its attention keeps a KV cache of its own (the HybridCache's MLA layer after the decoder's, in the same
pages as the sequence). So after every step, for each speculating sequence, the layer runs over the positions the
target just computed and kept (their hidden states, and the tokens that followed them), writing its cache there,
and its prediction at the last position is the first draft. Each further draft runs the layer one position on,
reading its own output h'' in place of the main model's hidden state there (unknown until the target computes
it), and the draft just made. Those speculative positions of the MTP cache are overwritten next step, when the
layer runs over them again with the target's real hidden states. Drafts are the layer's argmax (among a token
map's tokens with one, spec.token_map): deterministic, so the acceptance rule in verify.py keeps the output
distribution the target's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ...layers.batch import ForwardBatch
from ...layers.cache import HybridCache
from ...models.kimi import KimiForCausalLM
from ..cache.page_table import PageTable
from .token_map import HotHead


@dataclass(frozen=True)
class DraftInput:
    """One sequence's positions start..start+m-1 just computed by the target: where their hidden states lie (rows
    first_row.. of the forward-th of the hidden states kept since the last draft, ModelRunner.kept), the tokens
    that followed them [m], and how far the sequence's pages reach (tokens). Plain data, so that every rank of a
    distributed instance can draft from its own kept hidden states."""

    slot: int
    start: int
    forward: int
    first_row: int
    next_ids: list[int]
    capacity: int
    count: int                         # drafts wanted

    def hidden(self, kept: list[torch.Tensor]) -> torch.Tensor:
        """[m, D]: the hidden states of this input's positions, among the kept forwards' [T, D] hidden states."""
        return kept[self.forward][self.first_row:self.first_row + len(self.next_ids)]


class MTPDrafter:
    """Runs the first MTP layer over a step's newly computed positions and chains it for the drafts; with hot_head
    (the layer's head cut to a token map), drafts among the map's tokens."""

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, page_table: PageTable,
                 hot_head: HotHead | None = None):
        self.model, self.cache, self.page_table, self.hot_head = model, cache, page_table, hot_head
        self.device = model.device

    @torch.inference_mode()
    def draft(self, inputs: list[DraftInput], kept: list[torch.Tensor]) -> list[list[int]]:
        """Run the layer over every input's positions (its cache needs them even where no draft is wanted yet,
        as in a prompt's earlier chunks), then up to input.count draft tokens per input (fewer where its pages end
        first). kept: the hidden states the inputs point into."""
        drafts: list[list[int]] = [[] for _ in inputs]
        if not inputs:
            return drafts
        lengths = [len(x.next_ids) for x in inputs]
        hidden = self._forward(inputs, [x.start for x in inputs], torch.cat([x.hidden(kept) for x in inputs]),
                               [t for x in inputs for t in x.next_ids], lengths)
        hidden = hidden[torch.tensor(list(itertools.accumulate(lengths)), device=self.device) - 1]    # last rows
        ends = [x.start + n for x, n in zip(inputs, lengths)]           # the position each next draft is read at
        going = [i for i, x in enumerate(inputs) if x.count > 0]
        while going:
            tokens = self._tokens(hidden[going]).tolist()
            for i, token in zip(going, tokens):
                drafts[i].append(token)
            going = [i for i in going if len(drafts[i]) < inputs[i].count and ends[i] < inputs[i].capacity]
            if going:
                hidden = hidden.clone()
                hidden[going] = self._forward([inputs[i] for i in going], [ends[i] for i in going], hidden[going],
                                              [drafts[i][-1] for i in going], [1] * len(going))
                for i in going:
                    ends[i] += 1
        return drafts

    def _tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output h'' [R, D] -> its draft tokens [R]: the argmax of its head."""
        if self.hot_head is None:
            return self.model.mtp_head(hidden).argmax(-1)
        return self.hot_head(self.model.mtp_layers[0].shared_head.norm(hidden))

    def _forward(self, inputs: list[DraftInput], starts: list[int], hidden: torch.Tensor, next_ids: list[int],
                 lengths: list[int]) -> torch.Tensor:
        """The layer's output h'' [T, D] over lengths[i] positions from starts[i] (writing its latent cache)."""
        slots = torch.tensor([x.slot for x in inputs], device=self.device)
        width = max(-(-x.capacity // self.cache.page_size) for x in inputs)
        batch = ForwardBatch.build(lengths, starts, slots, self.page_table.gather(slots, width),
                                   self.cache.page_size, self.device)
        return self.model.mtp_hidden(hidden, torch.tensor(next_ids, device=self.device), batch, self.cache)
