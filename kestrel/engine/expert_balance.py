"""Expert-parallel load balancing between steps (SGLang's --enable-eplb): count, re-place, move the weights.

Every rank runs the same steps, so every rank's balancer reaches a window's end after the same step (every
`--eplb-rebalance-num-iterations` forwards) and they act together. At a window's end the ranks sum each MoE
layer's routed-pair counts (RoutedExperts.load) and gather the pairs each rank computed (the load per rank, for
/metrics). With rebalancing on, each layer then gets a new placement (kestrel.distributed.eplb.place, the same on
every rank), each slot whose expert changes copies it from the rank's own slots or receives it from the lowest EP
rank holding it (one all-to-all per weight tensor, between ranks of the same expert-TP share), and the routing
table changes at once. Requests run on across it: replicas are copies, so a token's experts compute the same
function wherever they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import eplb
from ..distributed.parallel import Parallel
from ..layers.moe import RoutedExperts


class ExpertBalancer:
    """The MoE layers of one rank's model; `after_step` after every forward (every rank)."""

    def __init__(self, model: nn.Module, par: Parallel, window: int, rebalance: bool):
        self.layers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
        self.par, self.window, self.rebalance = par, window, rebalance
        self.steps = 0
        self.rank_load: list[int] = []       # pairs each EP rank computed over the last window (all layers)
        self.rebalances = 0

    def after_step(self) -> None:
        self.steps += 1
        if self.steps % self.window == 0 and self.layers:
            self.end_window()

    @property
    def imbalance(self) -> float:
        """max / mean of the last window's load per EP rank (1.0 before the first window)."""
        return eplb.imbalance(torch.tensor(self.rank_load, dtype=torch.float64)) if self.rank_load else 1.0

    @torch.no_grad()
    def end_window(self) -> None:
        layout = self.par.layout
        computed = torch.tensor([sum(layer.computed for layer in self.layers)], dtype=torch.int64)
        every = [torch.empty_like(computed) for _ in range(layout.tp_size)] if self.par.group else [computed]
        if self.par.group is not None:
            dist.all_gather(every, computed, group=self.par.group)
        self.rank_load = [int(c) for c in every[::layout.moe_tp_size]]       # one rank per EP group
        loads = torch.stack([layer.load.cpu() for layer in self.layers])      # [layers, E]
        if self.par.group is not None:
            dist.all_reduce(loads, group=self.par.group)
        if not layout.moe_a2a:       # every rank routed every token
            loads //= layout.tp_size
        for layer, load in zip(self.layers, loads):
            if self.rebalance:
                new = eplb.place(load, layout.ep_size, layer.slots, current=layer.placement)
                self._move(layer, new)
                layer.set_placement(new)
            else:
                layer.set_placement(layer.placement)        # counts start again
        self.rebalances += self.rebalance

    def _move(self, layer: RoutedExperts, new: torch.Tensor) -> None:
        """Put each of this rank's slots' experts under `new` in place: from its own old slots, or received."""
        layout, slots = self.par.layout, layer.slots
        old = layer.placement
        sends, receives = [], []     # (peer rank, local slot), by destination and its slot on both sides
        local: list[tuple[int, int]] = []    # (destination slot, source slot) on this rank
        crossing = False                     # any weight crosses ranks (the same answer on every rank)
        for group in range(layout.ep_size):
            held = old[group * slots:(group + 1) * slots].tolist()
            for j in range(slots):
                e = int(new[group * slots + j])
                if held[j] == e:
                    continue
                if e in held:
                    if group == layout.ep_rank:
                        local.append((j, held.index(e)))
                    continue
                crossing = True
                source = int((old == e).nonzero()[0])
                src_rank = source // slots * layout.moe_tp_size + layout.moe_tp_rank
                dst_rank = group * layout.moe_tp_size + layout.moe_tp_rank
                if src_rank == layout.tp_rank:
                    sends.append((dst_rank, source % slots))
                if dst_rank == layout.tp_rank:
                    receives.append((src_rank, j))
        receives.sort(key=lambda r: r[0])     # by source, then (stable) by slot, as each source sends them
        sent = [sum(1 for r, _ in sends if r == peer) for peer in range(layout.tp_size)]
        received = [sum(1 for r, _ in receives if r == peer) for peer in range(layout.tp_size)]
        for tensor in layer.slot_tensors().values():
            rows = tensor[[s for _, s in sends]]
            if crossing:
                rows = self.par.all_to_all(rows, sent, received, "eplb")
            moved = tensor.clone()
            moved[[dst for dst, _ in local]] = tensor[[src for _, src in local]]
            moved[[dst for _, dst in receives]] = rows
            tensor.data = moved
        layer.refresh_copies()
