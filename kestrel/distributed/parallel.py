"""What the layers see of the distributed runtime: the rank layout and the tensor-parallel group's collectives.

`SINGLE` is the one-process instance (every collective is the identity), so layers never branch on whether they
run distributed. Collectives count the bytes each rank contributes, per kind, for the communication benchmark. Under
deterministic inference (kestrel.ops.batch_invariant's `invariant()`) sums over ranks add the ranks' parts in rank
order.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
import torch.distributed as dist

from ..ops import batch_invariant
from .layout import ParallelLayout


class Parallel:
    """The layout and the TP group of this rank's stage (None when it has one rank); with decode context
    parallelism, the rank's DCP group and the group of its TP group's ranks that hold the same positions.

    `attn` is what attention and the vocabulary use: this Parallel itself, or under DP attention a Parallel over the
    rank's DP group (layout.attention()); `dp_group` then joins the ranks with the same place in every DP group,
    over which dp_gather collects the groups' attention outputs. `ffn` is what dense MLPs and shared experts use:
    `attn` with the all-to-all MoE (their tokens stay with the attention group), this Parallel otherwise."""

    def __init__(self, layout: ParallelLayout = ParallelLayout(), group: dist.ProcessGroup | None = None,
                 via_host: bool = False, dcp_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]
                 = (None, None), dp_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)):
        if layout.tp_size > 1 and group is None:
            raise ValueError("a tensor-parallel layout needs its process group.")
        self.layout = layout
        self.group = group
        self.dcp_group, self.cross_group = dcp_groups
        self.via_host = via_host      # GPU tensors go through host memory (gloo between ranks sharing a GPU)
        self.bytes_sent: Counter[str] = Counter()
        self.attn, self.dp_group = self, None
        if layout.dp_size > 1:
            attn_group, self.dp_group = dp_groups
            self.attn = Parallel(layout.attention(), attn_group, via_host, dcp_groups)
            self.attn.bytes_sent = self.bytes_sent

    @classmethod
    def for_shapes(cls, layout: ParallelLayout) -> Parallel:
        """A rank's Parallel without process groups, to build its modules on the meta device (their shapes and
        bytes); its collectives must never run."""
        par = cls()
        par.layout = layout
        if layout.dp_size > 1:
            par.attn = cls.for_shapes(layout.attention())
        return par

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def ffn(self) -> Parallel:
        return self.attn if self.layout.moe_a2a else self

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the TP ranks (x contiguous, reduced in place and returned)."""
        return self._all_reduce(x, dist.ReduceOp.SUM, self.group, "all_reduce")

    def dcp_all_reduce(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """The sum (or op) of x over the DCP group (in place)."""
        return self._all_reduce(x, op, self.dcp_group, "dcp_all_reduce")

    def cross_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the TP group's ranks that hold the same positions as this one (in place)."""
        return self._all_reduce(x, dist.ReduceOp.SUM, self.cross_group, "dcp_all_reduce")

    def dcp_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every DCP rank's x (the same shape on all) stacked in rank order: [dcp, *x.shape]."""
        if self.dcp_group is None:
            return x.unsqueeze(0)
        x = x.contiguous()
        self.bytes_sent["dcp_all_gather"] += x.nbytes
        host = x.cpu() if self.via_host else x
        parts = [torch.empty_like(host) for _ in range(self.layout.dcp_size)]
        dist.all_gather(parts, host, group=self.dcp_group)
        return torch.stack(parts).to(x.device)

    def _all_reduce(self, x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None,
                    kind: str) -> torch.Tensor:
        if group is None:
            return x
        if op == dist.ReduceOp.SUM and batch_invariant.active():
            return x.copy_(self._sum_in_rank_order(x, group))
        self.bytes_sent[kind] += x.nbytes
        if self.via_host:
            host = x.cpu()
            dist.all_reduce(host, op=op, group=group)
            return x.copy_(host)
        dist.all_reduce(x, op=op, group=group)
        return x

    def _sum_in_rank_order(self, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """Every rank's x gathered and summed rank 0 first (deterministic inference): an all-reduce adds the ranks'
        parts in an order that depends on where an element falls among the chunks it splits the tensor into, so,
        past two ranks, on the batch's size."""
        self.bytes_sent["all_gather"] += x.nbytes
        host = x.contiguous().cpu() if self.via_host else x.contiguous()
        parts = [torch.empty_like(host) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, host, group=group)
        return functools.reduce(torch.add, parts).to(x.device)

    def dp_gather(self, x: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """Every DP group's rows in group order: x [counts[dp_rank], ...] -> [sum(counts), ...] (parts padded to the
        largest for the collective)."""
        return self._gather_rows(x, counts, self.dp_group, "dp_all_gather")

    def gather_rows(self, x: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """Every TP rank's rows in rank order: x [counts[tp_rank], ...] -> [sum(counts), ...]."""
        return self._gather_rows(x, counts, self.group, "all_gather")

    def _gather_rows(self, x: torch.Tensor, counts: tuple[int, ...], group: dist.ProcessGroup | None,
                     kind: str) -> torch.Tensor:
        if group is None or not max(counts):
            return x
        padded = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, max(counts) - x.shape[0])).contiguous()
        self.bytes_sent[kind] += padded.nbytes
        host = padded.cpu() if self.via_host else padded
        parts = [torch.empty_like(host) for _ in counts]
        dist.all_gather(parts, host, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, counts)]).to(x.device)

    def exchange_counts(self, counts: list[int]) -> list[int]:
        """How many rows every TP rank will send this one, given how many this one sends each (counts[r] to rank
        r): the sizes an all_to_all needs on both sides."""
        if self.group is None:
            return counts
        received = torch.empty(len(counts), dtype=torch.int64)
        dist.all_to_all_single(received, torch.tensor(counts, dtype=torch.int64), group=self.group)
        self.bytes_sent["a2a_counts"] += 8 * (len(counts) - 1)
        return received.tolist()

    def all_to_all(self, x: torch.Tensor, sent: list[int], received: list[int], kind: str) -> torch.Tensor:
        """Rows of x [sum(sent), ...] go sent[r] at a time, in order, to TP rank r; returns the rows every rank sent
        this one, in rank order [sum(received), ...]. bytes_sent[kind] counts the rows that leave this rank."""
        if self.group is None:
            return x
        row = x[0].nbytes if x.shape[0] else 0
        self.bytes_sent[kind] += row * (sum(sent) - sent[self.layout.tp_rank])
        host = x.contiguous().cpu() if self.via_host else x.contiguous()
        out = host.new_empty((sum(received), *x.shape[1:]))
        dist.all_to_all_single(out, host, received, sent, group=self.group)
        return out.to(x.device)

    def all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate along the last dim every rank's x [..., sizes[rank]] -> [..., sum(sizes)] (parts may differ
        by size; they are padded to the largest for the collective)."""
        if self.group is None:
            return x
        width = max(sizes)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        self.bytes_sent["all_gather"] += padded.nbytes
        if self.via_host:
            padded = padded.cpu()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1).to(x.device)


SINGLE = Parallel()
