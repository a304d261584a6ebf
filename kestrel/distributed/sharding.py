"""The sharding rules: which tensor of the model is split along which dim over which axis of the rank layout.

One table, read by everything that needs a rank's share of the weights: `shard_model_` gives a (meta) model its
per-rank shapes, the checkpoint loader reads each rank's slice of every tensor, and `shard_bytes` counts a rank's
weight bytes from the full model without loading it (what a memory planner or the cookbook needs). Tensors no rule
names are replicated on every rank.

Units keep packed formats whole: an MXFP4 expert's intermediate width is split on 32-value blocks, which are
32 rows of w1/w3, 16 packed bytes of w2 and one w2 scale.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .layout import MXFP4_BLOCK, ParallelLayout, partition


class Axes(Protocol):
    """A rank's place along the sharding axes: the engine's ParallelLayout, or a planned layout (the cookbook's)."""

    def axis(self, name: str) -> tuple[int, int]:
        """(this rank's index, parts) along "attn_tp", "tp", "ffn", "ep" or "moe_tp"."""


@dataclass(frozen=True)
class Split:
    """Dim `dim` of a tensor is split over layout axis `axis` ("attn_tp", "tp", "ffn", "ep", "moe_tp") in whole
    units of `unit`. Attention and the vocabulary split over the attention-TP group, dense MLPs and shared experts
    over the "ffn" axis: the whole TP group, or with the all-to-all MoE the attention group (the two differ only
    under DP attention, which the cookbook plans for SGLang)."""

    dim: int
    axis: str
    unit: int = 1


_COLUMN, _ROW = (Split(0, "ffn"),), (Split(1, "ffn"),)
_HEADS, _HEADS_IN = (Split(0, "attn_tp"),), (Split(1, "attn_tp"),)
_EXPERT_ROWS = lambda unit: (Split(0, "ep"), Split(1, "moe_tp", unit))     # noqa: E731  [E, I, ...]
_EXPERT_COLS = lambda unit: (Split(0, "ep"), Split(2, "moe_tp", unit))     # noqa: E731  [E, D, I...]

RULES: list[tuple[str, tuple[Split, ...]]] = [
    # KDA (heads): q/k/v/gate/beta projections, short convs, decay parameters; MLA: query and kv_b head projections
    (r"self_attn\.(q|k|v|g|f_b|g_b|b|q_b|kv_b)_proj\.weight$", _HEADS),
    (r"self_attn\.[qkv]_conv1d\.weight$", _HEADS),
    (r"self_attn\.(A_log|dt_bias)$", _HEADS),
    (r"self_attn\.indexer\.(wq_b|weights_proj)\.weight$", _HEADS),        # indexer heads; wk, k_norm replicated
    (r"self_attn\.o_proj\.weight$", _HEADS_IN),                             # row-parallel outputs
    (r"(\.mlp|\.shared_experts)\.(gate|up)_proj\.weight$", _COLUMN),        # dense MLP and shared experts
    (r"(\.mlp|\.shared_experts)\.down_proj\.weight$", _ROW),
    (r"(^|\.)(embed_tokens|lm_head|shared_head\.head)\.weight$", _HEADS),   # vocabulary
    (r"\.experts\.(w1|w3)$", _EXPERT_ROWS(1)),                              # routed experts: dense [E, I, D]
    (r"\.experts\.w2$", _EXPERT_COLS(1)),                                   # [E, D, I]
    (r"\.experts\.(w1|w3)_(packed|scale)$", _EXPERT_ROWS(MXFP4_BLOCK)),     # MXFP4 [E, I, D/2], [E, I, D/32]
    (r"\.experts\.w2_packed$", _EXPERT_COLS(MXFP4_BLOCK // 2)),              # [E, D, I/2]
    (r"\.experts\.w2_scale$", _EXPERT_COLS(1)),                             # [E, D, I/32]
]
_COMPILED = [(re.compile(pattern), splits) for pattern, splits in RULES]


def splits_of(name: str) -> tuple[Split, ...]:
    """The splits of the model tensor `name` (a state_dict key); () when it is replicated."""
    for pattern, splits in _COMPILED:
        if pattern.search(name):
            return splits
    return ()


def split_slices(splits: tuple[Split, ...], shape: tuple[int, ...], layout: Axes) -> tuple[slice, ...]:
    """The rank's slice, one per dim, of a full tensor of `shape` split by `splits`."""
    slices = [slice(None)] * len(shape)
    for split in splits:
        index, parts = layout.axis(split.axis)
        slices[split.dim] = slice(*partition(shape[split.dim], parts, index, split.unit))
    return tuple(slices)


def split_numel(splits: tuple[Split, ...], shape: tuple[int, ...], layout: Axes) -> int:
    """Elements of the rank's slice of a full tensor of `shape` split by `splits`."""
    numel = 1
    for s, n in zip(split_slices(splits, shape, layout), shape):
        numel *= len(range(*s.indices(n)))
    return numel


def local_slices(name: str, shape: tuple[int, ...], layout: Axes) -> tuple[slice, ...]:
    """This rank's slice of the full tensor `name` of `shape`, one slice per dim."""
    return split_slices(splits_of(name), shape, layout)


def local_shape(name: str, shape: tuple[int, ...], layout: Axes) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(local_slices(name, shape, layout), shape))


def shard_model_(model: nn.Module, layout: ParallelLayout) -> nn.Module:
    """Give every split tensor of a meta-device model this rank's shape (in place; tied weights stay tied)."""
    if layout.world_size == 1:
        return model
    replaced: dict[int, torch.Tensor] = {}
    for name, tensor in list(model.state_dict(keep_vars=True).items()):
        if not tensor.is_meta:
            raise ValueError("shard_model_ reshapes a model on the meta device, before its weights are loaded.")
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if id(tensor) not in replaced:
            new = torch.empty(local_shape(name, tuple(tensor.shape), layout), dtype=tensor.dtype, device="meta")
            replaced[id(tensor)] = nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
        if isinstance(tensor, nn.Parameter):
            setattr(module, attr, replaced[id(tensor)])
        else:
            module._buffers[attr] = replaced[id(tensor)]
    return model


def shard_bytes(model: nn.Module, layout: Axes) -> int:
    """Bytes of the weights rank layout.rank holds, from the full model (any device, meta included)."""
    seen: set[int] = set()
    total = 0
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += split_numel(splits_of(name), tuple(tensor.shape), layout) * tensor.element_size()
    return total
