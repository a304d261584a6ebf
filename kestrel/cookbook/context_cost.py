"""What one token costs at a context length: the work of one sequence that depends on its context, on one rank.

Per token of one sequence at `context` cached tokens, summed over the model's layers:
- the lightning indexer's scan (K3.1): every cached index key read and scored by every index head,
  2 x Hi x (D + 1) flops per key and layer (the dot product, then relu, head weight and head sum);
- attention over the selected keys: min(context, index_topk) latents (every cached one without an indexer) read and
  multiplied in the absorbed form, 2 x H x (2 x kv_lora_rank + rope) flops per key and layer (the scores over the
  whole latent, the values over its first kv_lora_rank);
- KDA: the state read and written once, and 7 x dk x dv flops per head and layer (decay, the delta rule's read
  and write, the output), the same at every context.
Heads split over the attention-TP group, cached keys and latents over DCP. A decode token reads all of it; a prompt
token of a `context`-token prompt scores (context + 1) / 2 keys on average and attends to the mean of
min(t, index_topk) over its positions t, while its chunk shares the key reads: prefill is counted in flops.

Weights, projections and the MoE cost the same at every context and are the decode roofline's (roofline.py), so a
step's growth from one context to another is this module's difference between them. `seconds` turns bytes and flops
into a lower bound on a device that reads `bandwidth` bytes/s and multiplies `flop_rate` flops/s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .calculator import CacheSettings
from .layout import Layout
from .model import ModelFacts

KDA_FLOPS_PER_STATE_VALUE = 7
"""Decode flops per value of a KDA head's dk x dv state: decay (1), S^T k (2), the rank-1 update (2), q^T S (2)."""


@dataclass(frozen=True)
class Part:
    """One component's bytes read and flops, per token."""

    bytes: float
    flops: float

    def seconds(self, bandwidth: float, flop_rate: float) -> float:
        """The time this part takes at least: its reads or its multiplies, whichever is slower."""
        return max(self.bytes / bandwidth, self.flops / flop_rate)


@dataclass(frozen=True)
class ContextCost:
    """Per token of one sequence at `context`, on one rank (see the module docstring)."""

    context: int
    selected: int                    # keys each decode token attends to
    index_scan: Part                 # zero without an indexer
    attention: Part
    kda_state: Part
    prefill_index_flops: float       # per prompt token of a `context`-token prompt
    prefill_attention_flops: float

    @property
    def decode(self) -> Part:
        parts = (self.index_scan, self.attention, self.kda_state)
        return Part(sum(p.bytes for p in parts), sum(p.flops for p in parts))

    def decode_seconds(self, bandwidth: float, flop_rate: float) -> float:
        """A decode token's context-dependent time at least: each part at its own bound."""
        return sum(p.seconds(bandwidth, flop_rate) for p in (self.index_scan, self.attention, self.kda_state))

    def prefill_seconds(self, flop_rate: float) -> float:
        """A prompt token's context-dependent time at least."""
        return (self.prefill_index_flops + self.prefill_attention_flops) / flop_rate

    def as_dict(self) -> dict:
        return asdict(self)


def mean_selected(context: int, topk: int | None) -> float:
    """The mean over positions t = 1..context of min(t, topk) (topk None: no cap)."""
    if topk is None or context <= topk:
        return (context + 1) / 2
    return (topk * (topk + 1) / 2 + (context - topk) * topk) / context


def context_cost(model: ModelFacts, context: int, settings: CacheSettings = CacheSettings(),
                 layout: Layout = Layout(tp=1)) -> ContextCost:
    """One token's context-dependent bytes and flops at `context` (module docstring); kestrel's cache layout when
    settings.row_scales."""
    if context < 1:
        raise ValueError(f"the context must be at least 1 token, got {context}.")
    config = model.config
    heads, dcp = layout.attention_tp, layout.dcp
    mla, kda = len(config.mla_layers), len(config.kda_layers)
    topk = config.index_topk if config.has_indexer else None
    selected = min(context, topk) if topk else context
    index_per_key = mla * 2 * config.index_n_heads * (config.index_head_dim + 1) / heads / dcp
    attention_per_key = mla * 2 * config.num_attention_heads * (2 * config.kv_lora_rank + config.qk_rope_head_dim) \
        / heads / dcp
    key_bytes = model.index_key_bytes_per_token(settings.kv_dtype, row_scales=settings.row_scales)
    latent_bytes = model.latent_bytes_per_token(settings.kv_dtype, row_scales=settings.row_scales)
    state_values = kda * config.kda_num_heads * config.kda_head_dim ** 2 / heads
    return ContextCost(
        context=context, selected=selected,
        index_scan=Part(context * key_bytes / dcp, context * index_per_key) if topk else Part(0, 0),
        attention=Part(selected * latent_bytes / dcp, selected * attention_per_key),
        kda_state=Part(2 * model.state_bytes_per_slot(settings.ssm_dtype) / heads,
                       KDA_FLOPS_PER_STATE_VALUE * state_values),
        prefill_index_flops=(context + 1) / 2 * index_per_key if topk else 0.0,
        prefill_attention_flops=mean_selected(context, topk) * attention_per_key)
