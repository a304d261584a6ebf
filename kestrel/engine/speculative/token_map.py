"""FR-Spec's draft vocabulary (SGLang's --speculative-token-map): model drafters choose among frequent tokens only.

A model drafter (the MTP layer, the block draft) takes each draft token as the argmax of its logits through an LM
head [vocab, D]; for a large vocabulary (K3's 163,840 rows) that product costs most of a draft. With a token map
the drafter multiplies only the rows of the map's tokens (a copy of them, made once at load and counted in the
memory plan) and maps the winning row back to its token id. A token outside the map can no longer be drafted,
which costs acceptance only where the target itself writes it; verification still reads the target's full logits,
so the output is unchanged.

The file is SGLang's: a torch-saved 1-D integer tensor (or list) of token ids, such as FR-Spec's freq_32768.pt;
tools/token_map.py writes one from a model's own greedy continuations. Under tensor parallelism each rank keeps the
map's rows of its share of the vocabulary, and the ranks' logits are gathered in vocabulary order, as the full
head's are.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ...distributed.parallel import Parallel
from ...layers.linear import column_major, column_major_pays, linear
from ...layers.parallel import vocab_range


def load_token_map(path: str | Path, vocab: int) -> torch.Tensor:
    """The distinct token ids of the map at path, ascending [H] int64; a ValueError saying what is wrong."""
    flag = f"--speculative-token-map {path}"
    try:
        ids = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{flag}: no such file.") from None
    except Exception as e:
        raise ValueError(f"{flag} is not a torch-saved tensor of token ids ({type(e).__name__}: {e}).") from None
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        ids = torch.tensor(ids, dtype=torch.long)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() \
            or ids.numel() == 0:
        raise ValueError(f"{flag} must hold a non-empty 1-D integer tensor of token ids.")
    ids = ids.long().unique()
    if ids[0] < 0 or ids[-1] >= vocab:
        raise ValueError(f"{flag} holds token ids outside the model's vocabulary of {vocab} (0..{vocab - 1}).")
    return ids


class HotHead(nn.Module):
    """An LM head cut to the token map's rows: the draft token among them with the largest logit.

    head_weight: this rank's rows of the head [V_rank, D] (its share of the vocabulary); ids: the map's ascending
    token ids [H]; par: the head's tensor-parallel group (the rows it splits the vocabulary over)."""

    def __init__(self, head_weight: torch.Tensor, ids: torch.Tensor, vocab: int, par: Parallel):
        super().__init__()
        self.par = par
        ranges = [vocab_range(vocab, par, rank) for rank in range(par.tp_size)]
        first, end = ranges[par.layout.tp_rank]
        mine = ids[(ids >= first) & (ids < end)] - first
        weight = head_weight.detach()[mine.to(head_weight.device)]
        self.register_buffer("weight", column_major(weight) if column_major_pays(weight) else weight)
        self.register_buffer("ids", ids.to(head_weight.device))
        self.sizes = [int(((ids >= a) & (ids < b)).sum()) for a, b in ranges]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] (after the head's norm) -> the draft token ids [...] int64."""
        return self.ids[self.logits(x).argmax(-1)]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] (after the head's norm) -> the logits of the map's tokens [..., H] fp32, in `ids` order."""
        return self.par.all_gather(linear(x, self.weight).float(), self.sizes)
