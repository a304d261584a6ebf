"""Decode roofline: the bytes each rank must read for one decode step, against the device's memory bandwidth.

One step of `batch` sequences at `context` tokens, each verifying `tokens_per_sequence` tokens (1 without
speculation), reads on each rank:
- weights: its share of every weight the step uses (the heaviest rank's, by the engine's sharding rules; the
  embedding table is not read, only B rows of it); of the routed experts only those the step's tokens touch:
  E x (1 - (1 - k/E)^T) per layer for T tokens under balanced routing. `assumptions="most_favourable"` instead
  takes the fewest bytes any engine could read: k experts per layer (every token on the same experts) and every
  weight split evenly over the TP group, nothing replicated;
- KV: the MLA latents of every cached token (K3), or, with K3.1's indexer, the indexer keys of every cached token
  plus the latents of the top-k selected ones; DCP splits both, the TP ranks of a group each read all of it;
- KDA state: each sequence's state, read and written once.
The step takes at least bytes / bandwidth on every pipeline stage, plus the time its collectives take on the
scale-up interconnect (kestrel.distributed.traffic: TP all-reduces and the logits' all-gather, DCP's exchange; not
overlapped with the reads, as kestrel's layers wait for each collective); a user's tokens/s is at most
tokens_per_sequence / (sum over stages), a device's at most batch x tokens_per_sequence / (slowest stage) / devices.
With the all-to-all MoE (layout.a2a) the collectives are a2a_traffic's: the dp groups each hold an equal share of the
step's sequences, and each rank dispatches expected_a2a_pairs (uniform routing) per token of its share and MoE layer
and returns as many rows; an all-to-all's wire bytes are the bytes it sends.
Compute, the draft model's own reads, and communication on the all-reduce path under DP attention, with pipeline
stages, or of the all-to-all path with DCP are not counted, so every figure is an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .calculator import CacheSettings
from .layout import Layout
from ..distributed.traffic import (Forward, a2a_traffic, comm_seconds, dcp_traffic, expected_a2a_pairs,
                                  tp_traffic)
from .model import DTYPES, EXPERTS, VOCAB, ModelFacts
from .moe_traffic import moe_layers

ASSUMPTIONS = ("planner", "most_favourable")


@dataclass(frozen=True)
class DecodeStep:
    """Bytes per rank (summed over pipeline stages) and the bounds they imply."""

    batch: int
    context: int
    tokens_per_sequence: int
    weight_bytes: int
    kv_bytes: int                    # MLA latents read
    index_key_bytes: int             # indexer keys scanned (0 without an indexer)
    state_bytes: int
    comm_seconds: float | None       # the step's collectives (kestrel.distributed.traffic); None when not modelled
    step_seconds: float | None       # None when the bandwidth is unknown
    tokens_per_s_per_user: float | None
    tokens_per_s_per_device: float | None

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.index_key_bytes + self.state_bytes

    def as_dict(self) -> dict:
        return asdict(self)


def experts_touched(tokens: int, experts: int, top_k: int, assumptions: str = "planner") -> float:
    """Distinct routed experts per MoE layer that `tokens` tokens read."""
    if assumptions not in ASSUMPTIONS:
        raise ValueError(f"unknown assumptions {assumptions!r}; choose one of: {', '.join(ASSUMPTIONS)}.")
    if assumptions == "most_favourable":
        return float(min(top_k, experts))
    return experts * (1 - (1 - top_k / experts) ** tokens)


def _stage_weight_bytes(model: ModelFacts, layout: Layout, stage: range, first: bool, last: bool,
                        expert_share: float, assumptions: str, engine: str) -> int:
    """Weight bytes one rank of this stage reads in a step (experts scaled by the touched share)."""
    rank, parts = ((layout.first_rank(engine), 1) if assumptions == "planner"
                   else (Layout(tp=1).first_rank(engine), layout.tp))
    read = dict(model.rank_bytes(rank, stage, first, last))
    if first:
        read[VOCAB] -= model.embedding_bytes(rank)
    return int(sum(n * (expert_share if sharding == EXPERTS else 1.0) for sharding, n in read.items()) / parts)


def decode_step(model: ModelFacts, layout: Layout, settings: CacheSettings, bandwidth_per_rank: float | None,
                devices: int, batch: int, context: int, tokens_per_sequence: int = 1,
                assumptions: str = "planner", engine: str = "sglang",
                interconnect_per_rank: float | None = None) -> DecodeStep:
    """Bytes and bounds of one decode step of `engine`'s ranks (see the module docstring); interconnect_per_rank:
    scale-up bytes/s of a rank (None: communication unknown)."""
    if batch < 1 or context < 1 or tokens_per_sequence < 1:
        raise ValueError("batch, context and tokens per sequence must each be at least 1.")
    config = model.config
    expert_share = (experts_touched(batch * tokens_per_sequence, config.num_experts, config.num_experts_per_token,
                                    assumptions) / config.num_experts) if config.num_experts else 0.0
    sequences = math.ceil(batch / layout.dp)
    selected = min(context, config.index_topk) if config.has_indexer else context
    stages = layout.stages(model.num_layers)
    per_stage = []
    for s, stage in enumerate(stages):
        weights = _stage_weight_bytes(model, layout, stage, s == 0, s == len(stages) - 1, expert_share, assumptions,
                                      engine)
        latent = model.latent_bytes_per_token(settings.kv_dtype, stage, settings.row_scales)
        kv = sequences * selected * latent / layout.dcp
        keys = sequences * context * model.index_key_bytes_per_token(settings.kv_dtype, stage,
                                                                     settings.row_scales) / layout.dcp
        state = 2 * sequences * model.state_bytes_per_slot(settings.ssm_dtype, stage) / layout.attention_tp
        per_stage.append((weights, int(kv), int(keys), int(state)))
    sums = [sum(column) for column in zip(*per_stage)]
    comm = _comm_seconds(model, layout, interconnect_per_rank, sequences, context, tokens_per_sequence)
    if bandwidth_per_rank is None:
        return DecodeStep(batch, context, tokens_per_sequence, *sums, comm, None, None, None)
    stage_seconds = [sum(row) / bandwidth_per_rank + (comm or 0.0) for row in per_stage]
    step = sum(stage_seconds)
    per_device = batch * tokens_per_sequence / max(stage_seconds) / devices
    return DecodeStep(batch, context, tokens_per_sequence, *sums, comm, step, tokens_per_sequence / step, per_device)


def _comm_seconds(model: ModelFacts, layout: Layout, interconnect_per_rank: float | None, sequences: int,
                  context: int, tokens_per_sequence: int) -> float | None:
    """Time one rank's collectives take in the step, at the interconnect's bandwidth (`sequences`: one DP group's);
    None when unknown or when the layout has what the formulas do not cover: pipeline stages, DP attention on the
    all-reduce path, DCP on the all-to-all path."""
    if layout.tp == 1:
        return 0.0
    if interconnect_per_rank is None or layout.pp > 1 or (layout.dcp > 1 if layout.a2a else layout.dp > 1):
        return None
    tokens = sequences * tokens_per_sequence
    forward = Forward(tokens, sequences, tokens_per_sequence, context, tokens)
    act_bytes = DTYPES[model.dtype].itemsize
    if layout.a2a:
        return _a2a_seconds(model, layout, forward, act_bytes, interconnect_per_rank)
    traffic = {**tp_traffic(model.config, layout.tp, forward, act_bytes),
               **dcp_traffic(model.config, layout.tp, layout.dcp, forward, act_bytes)}
    ranks = {kind: layout.dcp if kind.startswith("dcp") else layout.tp for kind in traffic}
    return comm_seconds(traffic, ranks, interconnect_per_rank)


def _a2a_seconds(model: ModelFacts, layout: Layout, group: Forward, act_bytes: int,
                 interconnect_per_rank: float) -> float:
    """Time a rank of the first DP group takes for the all-to-all path's collectives, every group holding `group`:
    all-reduces and all-gathers over the attention group, the hidden states' gather over the dp groups, and the
    dispatch and combine (the rows it sends) of the expected pairs of its share of the group's tokens."""
    config = model.config
    share = math.ceil(group.tokens / layout.attention_tp)
    pairs = round(expected_a2a_pairs(config, layout.tp, layout.ep, layout.redundant_experts) * share
                  * moe_layers(config))
    traffic = a2a_traffic(config, layout.tp, layout.dp, [group] * layout.dp, 0, act_bytes, pairs, pairs)
    ranks = {kind: layout.dp if kind.startswith("dp_") else layout.attention_tp if kind.startswith("all_")
             else layout.tp for kind in traffic}
    return comm_seconds(traffic, ranks, interconnect_per_rank)


def crossover_context(step: DecodeStep, reads: str) -> int | None:
    """The context length at which the step's `reads` ("kv" or "index_keys", linear in context) equal its weight
    reads; None when the model has none of them. Exact for index keys; for the latents of a model with an
    indexer, the top-k selection caps the reads, so there is no crossover beyond the cap."""
    per_context = (step.kv_bytes if reads == "kv" else step.index_key_bytes) / step.context
    if per_context == 0 or (reads == "kv" and step.index_key_bytes):
        return None
    return math.ceil(step.weight_bytes / per_context)
