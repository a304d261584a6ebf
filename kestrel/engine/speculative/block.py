"""The DFLASH drafter: a block draft model (kestrel.models.block_draft) proposes a whole block of tokens in one
forward, from the target's hidden state at a sequence's last computed position and the token after it.

It holds no per-sequence state: each step's drafts depend only on that step's DraftInput (the last kept position's
hidden state and next token), so a rejected draft or a rolled-back, preempted or aborted sequence leaves nothing
behind to repair. Drafts are the draft model's argmax (deterministic; among a token map's tokens with one,
spec.token_map), so verify.py's acceptance rule keeps the output distribution the target's.

With min_confidence (--speculative-draft-min-confidence), the blocks stop before the first draft at which the
product of the draft model's probabilities of a block's drafts so far, averaged over the step's drafting sequences,
falls below it: a verified token costs about a seventh of a decode step eagerly on the bundled model, so drafts
likely to be rejected are not worth verifying. The product estimates the chance that a draft is accepted, so the
average is the share of the step's verified tokens at that slot expected to be accepted; one length for every
block keeps the verification uniform (its compiled graph and batched KDA path). Where to stop depends on the draft
model alone, so the output is unchanged.

With a torch.compile backend (the CPU's `--enable-torch-compile`), the draft's forward runs compiled: one graph per
batch size, padded up to a power of two with rows nobody reads, always drafting num_slots tokens per row (a
sequence short of room keeps the first ones), so the graphs are few and made on first use.
"""

from __future__ import annotations

import logging

import torch

from ...models.block_draft import BlockDraftModel, block_logits, block_outputs
from ...models.kimi import KimiForCausalLM
from ..decode_graphs import compile_options
from .mtp import DraftInput
from .token_map import HotHead

log = logging.getLogger("kestrel")


class BlockDrafter:
    """Drafts up to num_slots tokens per sequence (at most the draft's block size) with one batched forward of the
    draft model, eager or compiled by the torch.compile backend `compile`; with hot_head, among the token map's
    tokens; with min_confidence, fewer (see the module docstring)."""

    def __init__(self, target: KimiForCausalLM, draft: BlockDraftModel, num_slots: int, compile: str | None = None,
                 hot_head: HotHead | None = None, min_confidence: float = 0.0):
        if draft.config.hidden_size != target.config.hidden_size:
            raise ValueError(f"the block draft has hidden size {draft.config.hidden_size} but the target model has "
                             f"{target.config.hidden_size}; pass a draft trained for this model.")
        self.target, self.draft_model, self.hot_head = target, draft, hot_head
        self.device = target.device
        self.num_slots = min(num_slots, draft.config.block_size)
        self.min_confidence = min_confidence
        # Two functions, not one testing hot_head: compiled graphs skip guards on modules, so a graph traced with a
        # token map's head would otherwise serve a drafter without one (and fail on None).
        self._tokens = self._argmax if hot_head is None else self._hot_argmax
        self.compiled = None
        if compile:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
            self.compiled = torch.compile(self._draft_tokens, backend=compile, dynamic=False, fullgraph=True,
                                          options=compile_options(compile))

    def _draft_tokens(self, hidden: torch.Tensor, next_ids: torch.Tensor, slots: int
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [N, D], next_ids [N] -> (the draft's tokens [N, slots] int64, with min_confidence the product of
        the draft's probabilities of each row's drafts so far [N, slots] fp32, else None)."""
        tokens, logits = self._tokens(hidden, next_ids, slots)
        if not self.min_confidence:
            return tokens, None
        return tokens, logits.softmax(-1).amax(-1).cumprod(-1)

    def _argmax(self, hidden: torch.Tensor, next_ids: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the draft's tokens [N, slots], its logits [N, slots, vocab])."""
        logits = block_logits(self.target, self.draft_model, hidden, next_ids, slots)
        return logits.argmax(-1), logits

    def _hot_argmax(self, hidden: torch.Tensor, next_ids: torch.Tensor, slots: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the draft's tokens among the token map's [N, slots], its logits of the map's tokens [N, slots, H])."""
        outputs = block_outputs(self.target, self.draft_model, hidden, next_ids, slots)
        logits = self.hot_head.logits(self.target.model.norm(outputs))
        return self.hot_head.ids[logits.argmax(-1)], logits

    @torch.inference_mode()
    def draft(self, inputs: list[DraftInput], kept: list[torch.Tensor]) -> list[list[int]]:
        """Up to min(input.count, num_slots) draft tokens per input, from its last hidden state [D] (among the kept
        hidden states) and next id."""
        drafts: list[list[int]] = [[] for _ in inputs]
        active = [i for i, x in enumerate(inputs) if x.count > 0]
        if not active:
            return drafts
        hidden = torch.stack([inputs[i].hidden(kept)[-1] for i in active])
        next_ids = torch.tensor([inputs[i].next_ids[-1] for i in active], device=self.device)
        drafted = self._compiled_tokens(hidden, next_ids) if self.compiled is not None else None
        if drafted is None:
            drafted = self._draft_tokens(hidden, next_ids, min(max(inputs[i].count for i in active), self.num_slots))
        tokens, confidence = drafted
        length = tokens.shape[1] if confidence is None else int((confidence.mean(0) >= self.min_confidence).sum())
        for row, i in zip(tokens.tolist(), active):
            drafts[i] = row[:min(inputs[i].count, length)]
        return drafts

    def _compiled_tokens(self, hidden: torch.Tensor, next_ids: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The compiled draft's _draft_tokens of num_slots tokens, its batch padded to a power of two; None (and
        eager drafting from then on) if compiling fails."""
        n = hidden.shape[0]
        size = 1 << (n - 1).bit_length()
        hidden = torch.cat([hidden, hidden.new_zeros(size - n, hidden.shape[1])])
        next_ids = torch.cat([next_ids, next_ids.new_zeros(size - n)])
        try:
            tokens, confidence = self.compiled(hidden, next_ids, self.num_slots)
            return tokens[:n], None if confidence is None else confidence[:n]
        except Exception as e:      # inductor failed (no C++ compiler, an op it cannot trace): draft eagerly
            log.warning("DFLASH: torch.compile of the block draft failed, drafting eagerly from now on: %s", e)
            self.compiled = None
            return None
