"""Model drafters over pipeline stages.

NEXTN and DFLASH draft from the target's final hidden states, through the MTP layers or the block draft, the final
norm, the LM head and the embedding of the tokens they draft from. Under pipeline stages all of that lives on the
last stage (which holds a copy of the embedding for it: kestrel.models.kimi, `embed_last_stage`), while rank 0,
which owns the scheduler, is on the first. So the last stage's ranks draft together (their TP group joins the
drafter's collectives, as a single stage's ranks do) and its first TP rank sends the drafts to rank 0; the stages
between keep no hidden states and draft nothing.
"""

from __future__ import annotations

import torch

from ...distributed.pipeline import StageLink
from .block import BlockDrafter
from .mtp import DraftInput, MTPDrafter


class StagedDrafter:
    """One rank's part in drafting over pipeline stages: `local` drafts on the last stage (None elsewhere); `link`
    carries the drafts from the last stage's first TP rank to rank 0."""

    def __init__(self, local: MTPDrafter | BlockDrafter | None, link: StageLink, device: torch.device):
        self.local, self.link, self.device = local, link, device

    def draft(self, inputs: list[DraftInput], kept: list[torch.Tensor | None]) -> list[list[int]]:
        """The drafts for inputs on rank 0 and the last stage (no drafts on the stages between)."""
        layout = self.link.layout
        width = max((x.count for x in inputs), default=0)
        if layout.last_stage:
            drafts = self.local.draft(inputs, kept)
            if layout.tp_rank == 0 and width:
                self.link.send_drafts(drafts, width, self.device)
                self.link.wait()
            return drafts
        if layout.rank == 0 and width:
            return self.link.recv_drafts(len(inputs), width, self.device)
        return [[] for _ in inputs]
