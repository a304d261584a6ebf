"""What the MoE layers move per token on the two expert paths, summed over every rank's wire: the all-reduce path
(`--moe-a2a-backend none`) and the all-to-all path (`--moe-a2a-backend torch`), counted as
kestrel.distributed.traffic counts them.

A forward of `tokens` tokens on a TP group of tp ranks, DP attention splitting it into dp groups of tp / dp ranks
(attention TP), each group holding an equal share of the tokens:
- all_reduce: every rank contributes each MoE layer's T x (expert_dim + hidden) rows of a latent MoE with shared
  experts (T x hidden otherwise) to one all-reduce over the tp ranks (DP attention does not change it: the FFNs run
  over every group's tokens); a ring sends 2 (tp - 1) / tp of it per rank.
- a2a: each token is dispatched from one rank of its group (a share of ceil(T / dp / attention TP) tokens per rank)
  to the other ranks holding its experts, expected_a2a_pairs per token and MoE layer under uniform routing: the
  row and 8 k bytes of slot ids and weights per pair out, the row back; plus 8 bytes of counts to every other rank
  per MoE layer. With attention TP > 1 the MoE layer also moves within the group: the shared experts' all-reduce of
  the group's T / dp x hidden rows and the all-gather of the routed sums (a ring sends attention TP - 1 parts).
The dense MLPs, attention, embedding and logits are not MoE traffic and are left out of both. Bytes per token are
the whole forward's wire bytes over every rank divided by `tokens`; the per-forward counts make the a2a figure
depend (slightly) on the tokens per forward.
"""

from __future__ import annotations

import math

from ..config import ModelConfig
from ..distributed.traffic import a2a_moe_traffic, expected_a2a_pairs, moe_reduce_width, routed_width, wire_bytes

PATHS = ("all_reduce", "a2a")
STEP_TOKENS = 256
"""Tokens in one forward over the whole TP group by default: a decode step of 256 sequences, the largest of the
planner's default roofline batches (planner.DEFAULT_BATCHES)."""


def moe_layers(config: ModelConfig) -> int:
    return sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))


def moe_bytes_per_token(config: ModelConfig, tp: int, ep: int, dp: int, path: str, act_bytes: int,
                        tokens: int = STEP_TOKENS, redundant: int = 0) -> float:
    """Wire bytes per token of the MoE layers over all tp ranks on `path` ("all_reduce" or "a2a"), for a forward of
    `tokens` tokens (see the module docstring); `redundant`: EPLB's extra expert slots (the a2a path's reach)."""
    if path not in PATHS:
        raise ValueError(f"unknown MoE path {path!r}; choose one of: {', '.join(PATHS)}.")
    if tp < 1 or dp < 1 or tp % dp or ep < 1 or tp % ep or tokens < 1:
        raise ValueError(f"tp {tp}, ep {ep}, dp {dp} and {tokens} tokens do not make a layout (ep and dp divide tp).")
    layers, hidden = moe_layers(config), config.hidden_size
    if path == "all_reduce":
        contributed = layers * tokens * moe_reduce_width(config) * act_bytes
        return wire_bytes("all_reduce", contributed, tp) * tp / tokens
    if ep == 1:
        raise ValueError("the all-to-all path needs expert parallelism (ep above 1): with ep 1 every rank holds every "
                         "expert and nothing is dispatched.")
    attn_tp = tp // dp
    group = math.ceil(tokens / dp)
    share = math.ceil(group / attn_tp)
    pairs = expected_a2a_pairs(config, tp, ep, redundant) * share * layers
    per_rank = sum(a2a_moe_traffic(config, tp, act_bytes, pairs, pairs).values())
    if attn_tp > 1:
        if config.num_shared_experts:
            per_rank += wire_bytes("all_reduce", layers * group * hidden * act_bytes, attn_tp)
        per_rank += wire_bytes("all_gather", layers * share * routed_width(config) * act_bytes, attn_tp)
    return per_rank * tp / tokens


def moe_traffic_rows(config: ModelConfig, eps: tuple[int, ...], attention_tps: tuple[int, ...], act_bytes: int,
                     tokens: int = STEP_TOKENS) -> list[tuple[int, int, float, float]]:
    """(ep, attention TP, all-reduce bytes per token, all-to-all bytes per token) at tp = ep, for each pair."""
    return [(ep, a, moe_bytes_per_token(config, ep, ep, ep // a, "all_reduce", act_bytes, tokens),
             moe_bytes_per_token(config, ep, ep, ep // a, "a2a", act_bytes, tokens))
            for ep in eps for a in attention_tps]
