"""The DFLASH drafter for published DFlash and DSpark drafts (kestrel.models.dflash_draft): the draft's layers attend
to the target's context, whose rows (per draft layer: an MLA latent, or a rotated key and value) the target's forward
keeps in pages beside its own latents (ContextWriter).

Each step, for each sequence that may speculate, the drafter reads the rows of its context (every position before
its anchor, the token after its last computed position) from the draft's pools and runs the draft over the block
[anchor, MASK, ...] at the positions after them; the argmax of its drafting slots (DFlash's 1.., DSpark's 0..) are
its drafts (among a token map's tokens with one; a DSpark draft's through its Markov head, slot after slot).

A position's rows depend on the tokens up to it only and are written with the target's latents, so they follow
them: a verification's rejected positions are written again by the forward that next computes them, prefix-cache
hits and preemption reuse or recompute them with the pages, and PD handoffs and HiCache carry them with the pages
(between instances that both hold the draft's pools: other handoffs do not fit and are refused). Drafts are
deterministic, so verify.py's acceptance rule keeps the output distribution the target's.
"""

from __future__ import annotations

import torch

from ...layers.batch import kv_rows
from ...models.dflash_draft import ContextWriter, draft_tokens, embed
from ...models.kimi import KimiForCausalLM
from ..cache.page_table import PageTable
from .mtp import DraftInput
from .token_map import HotHead


class DFlashDrafter:
    """Drafts up to num_slots tokens per sequence (at most the draft's spec.drafts) with the DFlash draft whose
    context the target's forward writes (target.model.draft_context)."""

    def __init__(self, target: KimiForCausalLM, page_table: PageTable, num_slots: int,
                 hot_head: HotHead | None = None):
        context: ContextWriter = target.model.draft_context
        self.target, self.draft_model, self.pools = target, context.draft, context.pools
        self.page_size, self.page_table, self.hot_head = context.cache.page_size, page_table, hot_head
        self.device = target.device
        self.num_slots = min(num_slots, self.draft_model.spec.drafts)

    @torch.inference_mode()
    def draft(self, inputs: list[DraftInput], kept: list[torch.Tensor]) -> list[list[int]]:
        """Up to min(input.count, num_slots) draft tokens per input (the kept hidden states are not needed: the
        context is in the pools)."""
        drafts: list[list[int]] = [[] for _ in inputs]
        active = [i for i, x in enumerate(inputs) if x.count > 0]
        if not active:
            return drafts
        tokens = self._block_tokens([inputs[i] for i in active])
        for row, i in zip(tokens.tolist(), active):
            drafts[i] = row[:min(inputs[i].count, self.num_slots)]
        return drafts

    def _block_tokens(self, inputs: list[DraftInput]) -> torch.Tensor:
        """Each input's block, drafted from its context: tokens [N, num_slots]."""
        anchors = torch.tensor([x.start + len(x.next_ids) for x in inputs], device=self.device)  # = context lengths
        slots = torch.tensor([x.slot for x in inputs], device=self.device)
        table = self.page_table.gather(slots, self._pages(inputs))
        positions = torch.arange(int(anchors.max()), device=self.device)
        seen = positions < anchors.unsqueeze(1)                                                  # [N, S]
        rows = torch.where(seen, kv_rows(table, torch.arange(len(inputs), device=self.device).unsqueeze(1),
                                         positions, self.page_size), 0)
        dtype = self.draft_model.fc.weight.dtype
        contexts = [torch.where(seen.unsqueeze(-1), pool.latent.read(rows, dtype), 0) for pool in self.pools]
        spec = self.draft_model.spec
        ids = torch.tensor([[x.next_ids[-1]] + [spec.mask_token_id] * (spec.block_size - 1) for x in inputs],
                           device=self.device)
        block = anchors.unsqueeze(1) + torch.arange(spec.block_size, device=self.device)        # its positions
        outputs = self.draft_model(embed(self.target, self.draft_model, ids), contexts, seen, block)
        outputs = outputs[:, spec.first_slot:spec.first_slot + self.num_slots]
        if self.hot_head is not None:
            return self.hot_head(outputs)
        return draft_tokens(self.target, self.draft_model, outputs, ids[:, 0])

    def _pages(self, inputs: list[DraftInput]) -> int:
        """The page-table columns the inputs' pages span."""
        return max(-(-x.capacity // self.page_size) for x in inputs)
