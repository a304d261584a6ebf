"""The DFLASH drafter: a block draft model (kestrel.models.block_draft) proposes a whole block of tokens in one
forward, from the target's hidden state at a sequence's last computed position and the token after it.

It holds no per-sequence state: each step's drafts depend only on that step's DraftInput (the last kept position's
hidden state and next token), so a rejected draft or a rolled-back, preempted or aborted sequence leaves nothing
behind to repair. Drafts are the draft model's argmax (deterministic), so verify.py's acceptance rule keeps the
output distribution the target's.
"""

from __future__ import annotations

import torch

from ...models.block_draft import BlockDraftModel, block_logits
from ...models.kimi import KimiForCausalLM
from .mtp import DraftInput


class BlockDrafter:
    """Drafts up to block_size tokens per sequence with one batched forward of the draft model."""

    def __init__(self, target: KimiForCausalLM, draft: BlockDraftModel):
        if draft.config.hidden_size != target.config.hidden_size:
            raise ValueError(f"the block draft has hidden size {draft.config.hidden_size} but the target model has "
                             f"{target.config.hidden_size}; pass a draft trained for this model.")
        self.target, self.draft_model = target, draft
        self.device = target.device

    @torch.inference_mode()
    def draft(self, inputs: list[DraftInput]) -> list[list[int]]:
        """Up to min(input.count, block_size) draft tokens per input, from its last hidden state [D] and next id."""
        drafts: list[list[int]] = [[] for _ in inputs]
        active = [i for i, x in enumerate(inputs) if x.count > 0]
        if not active:
            return drafts
        hidden = torch.stack([inputs[i].hidden[-1] for i in active])
        next_ids = torch.tensor([inputs[i].next_ids[-1] for i in active], device=self.device)
        slots = max(inputs[i].count for i in active)           # block_logits gives at most block_size
        tokens = block_logits(self.target, self.draft_model, hidden, next_ids, slots).argmax(-1).tolist()
        for row, i in zip(tokens, active):
            drafts[i] = row[:inputs[i].count]
        return drafts
