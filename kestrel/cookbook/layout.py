"""Parallel layouts as SGLang spells them, checked against a model, and what each rank holds under them.

World size = tp x pp ranks. Within a TP group: DP attention splits it into dp attention groups of tp / dp ranks
(attention TP); expert parallelism (ep) and decode context parallelism (dcp) subdivide it; pipeline parallelism
(pp) cuts the layers into pp contiguous stages of (nearly) equal layer counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..distributed.layout import ParallelLayout
from .first_rank import FirstRank
from .hardware import Device
from .model import ModelFacts


@dataclass(frozen=True)
class Layout:
    """Parallel sizes (SGLang's --tp-size, --dp-size with DP attention, --ep-size, --pp-size, --dcp-size), whether
    the routed experts' tokens are dispatched all-to-all (--moe-a2a-backend other than none) and EPLB's extra expert
    slots over the EP ranks (--ep-num-redundant-experts with --enable-eplb)."""

    tp: int = 8
    dp: int = 1
    ep: int = 1
    pp: int = 1
    dcp: int = 1
    a2a: bool = False
    redundant_experts: int = 0

    @property
    def world(self) -> int:
        """Engine ranks."""
        return self.tp * self.pp

    @property
    def attention_tp(self) -> int:
        return self.tp // self.dp

    def first_rank(self, engine: str = "sglang") -> FirstRank:
        """Rank 0 of `engine` ("kestrel" or "sglang") along the sharding axes: the heaviest rank (uneven splits give
        the first parts more)."""
        return FirstRank(self.attention_tp, self.tp, self.ep, engine == "sglang", self.a2a)

    def stages(self, num_layers: int) -> list[range]:
        """The layers of each pipeline stage, cut as kestrel's engine cuts them (ParallelLayout.stage_layers)."""
        engine = ParallelLayout(pp_size=self.pp)
        return [engine.stage_layers(num_layers, s) for s in range(self.pp)]

    def describe(self) -> str:
        parts = [f"TP{self.tp}"]
        parts += [f"{name}{size}" for name, size in (("DP", self.dp), ("EP", self.ep), ("PP", self.pp),
                                                     ("DCP", self.dcp)) if size > 1]
        moe = [what for what, on in (("all-to-all MoE", self.a2a),
                                     (f"{self.redundant_experts} redundant experts", self.redundant_experts)) if on]
        return " x ".join(parts) + (f" ({', '.join(moe)})" if moe else "")


def check_layout(layout: Layout, model: ModelFacts) -> None:
    """Raise one ValueError naming the first constraint the layout breaks for this model."""
    for name, size in (("tp", layout.tp), ("dp", layout.dp), ("ep", layout.ep), ("pp", layout.pp),
                       ("dcp", layout.dcp)):
        if size < 1:
            raise ValueError(f"--{name} must be at least 1, got {size}.")
    if layout.tp % layout.dp:
        raise ValueError(f"--dp {layout.dp} must divide --tp {layout.tp} (DP attention splits the TP group).")
    mla_heads, kda_heads = model.attention_heads
    for kind, heads in (("MLA", mla_heads), ("KDA", kda_heads)):
        if heads % layout.attention_tp:
            raise ValueError(f"{model.name} has {heads} {kind} heads, not divisible by the attention TP size "
                             f"{layout.attention_tp} (tp {layout.tp} / dp {layout.dp}); pick a tp / dp that divides "
                             f"{heads}.")
    if layout.tp % layout.ep:
        raise ValueError(f"--ep {layout.ep} must divide --tp {layout.tp} (experts are spread over the TP group).")
    experts = model.config.num_experts
    if experts and experts % layout.ep:
        raise ValueError(f"{model.name} has {experts} routed experts, not divisible by --ep {layout.ep}.")
    if layout.a2a and layout.ep == 1:
        raise ValueError("--moe-a2a-backend torch needs --ep above 1 (with one EP rank every rank holds every expert "
                         "and there is nothing to dispatch); pass --ep or --moe-a2a-backend none.")
    if layout.redundant_experts < 0 or layout.redundant_experts % layout.ep or (layout.redundant_experts
                                                                                 and layout.ep == 1):
        raise ValueError(f"--ep-num-redundant-experts {layout.redundant_experts} must be a multiple of --ep "
                         f"{layout.ep} above 1 (every EP rank holds as many expert slots), or 0.")
    if layout.attention_tp % layout.dcp:
        raise ValueError(f"--dcp {layout.dcp} must divide the attention TP size {layout.attention_tp}.")
    if layout.pp > model.num_layers:
        raise ValueError(f"--pp {layout.pp} exceeds the model's {model.num_layers} layers.")


@dataclass(frozen=True)
class NodeLayout:
    """How the ranks land on devices and nodes."""

    ranks: int
    devices: int
    devices_per_node: int | None    # None when the catalog does not know
    nodes: int | None

    def describe(self) -> str:
        if self.nodes is None:
            return f"{self.devices} devices (node size unknown)"
        return f"{self.nodes} x {self.devices_per_node} ({self.devices} devices)"


def node_layout(layout: Layout, device: Device, nodes: int | None = None) -> NodeLayout:
    """Devices and nodes for `layout` on `device`; `nodes`, when given, must hold every rank and leave no node idle."""
    devices = math.ceil(layout.world / device.ranks_per_device)
    per_node = device.devices_per_node
    if nodes is None:
        return NodeLayout(layout.world, devices, per_node, math.ceil(devices / per_node) if per_node else None)
    _check_nodes(layout, device, devices, nodes)
    return NodeLayout(layout.world, devices, per_node or math.ceil(devices / nodes), nodes)


def _check_nodes(layout: Layout, device: Device, devices: int, nodes: int) -> None:
    """Raise one ValueError when `nodes` cannot hold the layout's devices or would leave a node without work."""
    if nodes < 1:
        raise ValueError(f"--nodes must be at least 1, got {nodes}.")
    per_node = device.devices_per_node
    if per_node is None:
        if nodes > devices:
            raise ValueError(f"{layout.describe()} needs {devices} {device.id} devices, fewer than the {nodes} nodes "
                             f"given; pass at most --nodes {devices}.")
        return
    needed = math.ceil(devices / per_node)
    if nodes * per_node < devices:
        raise ValueError(f"{nodes} node(s) of {per_node} {device.id} hold {nodes * per_node} devices, fewer than the "
                         f"{devices} that {layout.describe()} needs; pass --nodes {needed}.")
    if nodes > needed:
        raise ValueError(f"{layout.describe()} needs {devices} {device.id} devices, {needed} node(s) of {per_node}; "
                         f"--nodes {nodes} would leave nodes idle, so pass --nodes {needed} or a larger layout.")
