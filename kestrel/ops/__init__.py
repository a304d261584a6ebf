"""Numerics kernels behind one interface per op.

`ops.torch` is the reference backend (CPU, autograd, written for clarity); faster backends must match it.
`ops.cpu` holds C++ kernels that the torch backend's compiled CPU paths call (tested against the same formulas).
Layers import ops from here, never from a backend directly.
"""

from .torch.attention import masked_attention, sparse_attention
from .torch.conv import causal_conv1d
from .torch.indexer import indexer_scores, indexer_topk, topk_mask
from .torch.kda import chunk_kda, recurrent_kda

__all__ = ["causal_conv1d", "chunk_kda", "indexer_scores", "indexer_topk", "masked_attention", "recurrent_kda",
           "sparse_attention", "topk_mask"]
