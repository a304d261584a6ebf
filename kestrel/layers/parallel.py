"""Tensor-parallel building blocks that communicate: a row-parallel linear and a vocabulary-parallel embedding.

Column-parallel projections are plain Linear modules (kestrel.layers.linear) whose weights the sharding rules
(kestrel.distributed.sharding) cut to this rank's output rows; they need no communication. Modules here are built
at full size, like every layer, and get their per-rank shapes from the same rules before their weights load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.layout import partition
from ..distributed.parallel import SINGLE, Parallel
from .linear import Linear, linear


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T: x [T, in/tp] (this rank's heads or columns) -> [T, out], all-reduced."""

    def __init__(self, in_features: int, out_features: int, par: Parallel = SINGLE):
        super().__init__(in_features, out_features, bias=False)
        self.par = par

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.par.all_reduce(linear(x, self.weight, packed=self.packed).contiguous())


class VocabParallelEmbedding(nn.Embedding):
    """Rank r holds the rows of its contiguous share of the vocabulary; ids [T] -> [T, D], all-reduced."""

    def __init__(self, num_embeddings: int, embedding_dim: int, par: Parallel = SINGLE):
        super().__init__(num_embeddings, embedding_dim)
        self.par = par
        self.first, self.end = vocab_range(num_embeddings, par, par.layout.tp_rank)

    def reset_parameters(self) -> None:
        """nn.Embedding's normal init, except on the meta device (models are built there before loading), where
        there is nothing to draw and torch's normal_ would import torch._dynamo (~1.7 s of start-up)."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.par.group is None:
            return super().forward(ids)
        mine = (ids >= self.first) & (ids < self.end)
        local = torch.where(mine, ids - self.first, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.par.all_reduce(out.contiguous())


def vocab_range(vocab: int, par: Parallel, rank: int) -> tuple[int, int]:
    """[first, end) of rank's share of the vocabulary (the sharding rules' partition of embed_tokens / lm_head)."""
    return partition(vocab, par.tp_size, rank)


def gather_vocab(local_logits: torch.Tensor, vocab: int, par: Parallel) -> torch.Tensor:
    """Every rank's logits over its vocabulary share [R, V/tp] -> the full logits [R, vocab] on every rank."""
    sizes = [end - first for first, end in (vocab_range(vocab, par, r) for r in range(par.tp_size))]
    return par.all_gather(local_logits, sizes)
