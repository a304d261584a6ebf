"""Acceptance length of a block draft on held-out text, under greedy verification against the target.

Protocol (the model card and tests/models/test_block_draft.py use this function): each prompt is continued
greedily by the target (float32) for `new_tokens` tokens; speculative greedy decoding emits exactly these tokens.
Decoding with blocks of k drafts is then replayed: after the first token, the draft proposes k tokens from the
hidden state at the last computed position p and the token p+1; the target accepts the longest prefix equal to its
own tokens and adds one of its own, so the step emits (accepted + 1) tokens and the next step drafts from position
p + accepted + 1. Steps whose block would reach past the continuation's end are not counted. Acceptance length =
tokens emitted / steps, as kestrel's SpecStats counts it. (The hidden states are those of one-token greedy steps;
the engine's verification computes them in blocks, which rounds differently in the last bits.)
"""

from __future__ import annotations

import torch

from block_draft_data import block_targets, greedy_with_hidden
from kestrel.models.block_draft import BlockDraftModel, block_logits
from kestrel.models.kimi import KimiForCausalLM

BATCH = 16
"""Prompts continued at once."""


@torch.inference_mode()
def measure(target: KimiForCausalLM, draft: BlockDraftModel, prompts: torch.Tensor, new_tokens: int,
            ks: tuple[int, ...]) -> dict:
    """prompts [n, L] int64 -> {"k=K": {"steps", "emitted", "acceptance_length"}} for each block size K in ks
    (at most the draft's block_size), plus "positions" and the draft's per-slot top-1 accuracy "slot_top1"."""
    length, size = prompts.shape[1], draft.config.block_size
    matches = []
    for chunk in prompts.split(BATCH):
        tokens, hidden = greedy_with_hidden(target, chunk, new_tokens)
        positions = slice(length - 1, tokens.shape[1] - 2)          # positions with at least one draft target
        n, count = chunk.shape[0], tokens.shape[1] - 2 - (length - 1)
        logits = block_logits(target, draft, hidden[:, positions].reshape(n * count, -1),
                              tokens[:, length:tokens.shape[1] - 1].reshape(-1))
        matches.append(logits.argmax(-1).view(n, count, size) == block_targets(tokens, length - 1, size))
    match = torch.cat(matches)                                       # [n, positions, block_size]
    report: dict = {"positions": match.shape[0] * match.shape[1],
                    "slot_top1": [match[:, :match.shape[1] - i, i].float().mean().item() for i in range(size)]}
    for k in ks:
        accepted = match[..., :k].int().cumprod(-1).sum(-1).tolist()
        steps = emitted = 0
        for row in accepted:
            p = 0
            while p + k <= len(row):                                 # all k targets inside the continuation
                steps, emitted, p = steps + 1, emitted + row[p] + 1, p + row[p] + 1
        report[f"k={k}"] = {"steps": steps, "emitted": emitted, "acceptance_length": emitted / steps}
    return report
