"""The NEXTN / MTP drafter: the model's own multi-token-prediction layer, chained for several draft tokens.

The MTP layer at position t reads the main model's hidden state h_t and the embedding of token t+1 and predicts
token t+2; its attention keeps a KV cache of its own (the HybridCache's MLA layer after the decoder's, in the same
pages as the sequence). So after every step, for each speculating sequence, the layer runs over the positions the
target just computed and kept (their hidden states, and the tokens that followed them), writing its cache there,
and its prediction at the last position is the first draft. Each further draft runs the layer one position on,
reading its own output h'' in place of the main model's hidden state there (unknown until the target computes
it), and the draft just made. Those speculative positions of the MTP cache are overwritten next step, when the
layer runs over them again with the target's real hidden states. Drafts are the layer's argmax: deterministic,
so the acceptance rule in verify.py keeps the output distribution the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...layers.batch import ForwardBatch
from ...layers.cache import HybridCache
from ...models.kimi import KimiForCausalLM
from ..cache.page_table import PageTable


@dataclass
class DraftInput:
    """One sequence's positions start..start+m-1 just computed by the target: their hidden states [m, D], the
    tokens that followed them [m], and how far the sequence's pages reach (tokens)."""

    slot: int
    start: int
    hidden: torch.Tensor
    next_ids: list[int]
    capacity: int
    count: int                         # drafts wanted


class MTPDrafter:
    """Runs the first MTP layer over a step's newly computed positions and chains it for the drafts."""

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, page_table: PageTable):
        self.model, self.cache, self.page_table = model, cache, page_table
        self.device = model.lm_head.weight.device

    @torch.inference_mode()
    def draft(self, inputs: list[DraftInput]) -> list[list[int]]:
        """Up to input.count draft tokens per input (fewer where its pages end first)."""
        drafts: list[list[int]] = [[] for _ in inputs]
        active = [i for i, x in enumerate(inputs) if x.count > 0]
        if not active:
            return drafts
        ends = [inputs[i].start + len(inputs[i].next_ids) for i in active]     # the position each draft is for
        logits, hidden = self._forward([inputs[i] for i in active], [inputs[i].start for i in active],
                                       torch.cat([inputs[i].hidden for i in active]),
                                       [t for i in active for t in inputs[i].next_ids],
                                       [len(inputs[i].next_ids) for i in active])
        last = torch.tensor([sum(len(inputs[j].next_ids) for j in active[:k + 1]) - 1 for k in range(len(active))])
        tokens, hidden = logits[last].argmax(-1).tolist(), hidden[last]
        for k, i in enumerate(active):
            drafts[i].append(tokens[k])
        while True:
            going = [k for k, i in enumerate(active) if len(drafts[i]) < inputs[i].count
                     and ends[k] < inputs[i].capacity]
            if not going:
                return drafts
            logits, out = self._forward([inputs[active[k]] for k in going], [ends[k] for k in going],
                                        hidden[going], [drafts[active[k]][-1] for k in going], [1] * len(going))
            tokens = logits.argmax(-1).tolist()
            hidden = hidden.clone()
            hidden[going] = out
            for j, k in enumerate(going):
                drafts[active[k]].append(tokens[j])
                ends[k] += 1

    def _forward(self, inputs: list[DraftInput], starts: list[int], hidden: torch.Tensor, next_ids: list[int],
                 lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.tensor([x.slot for x in inputs], device=self.device)
        width = max(-(-x.capacity // self.cache.page_size) for x in inputs)
        batch = ForwardBatch.build(lengths, starts, slots, self.page_table.gather(slots, width),
                                   self.cache.page_size, self.device)
        return self.model.mtp_draft(hidden, torch.tensor(next_ids, device=self.device), batch, self.cache)
