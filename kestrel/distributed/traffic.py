"""How many bytes each rank puts into each collective in one forward, as the layers issue them, and how long a ring
takes to move them: the one formula the communication benchmark checks against the engine's counters
(Parallel.bytes_sent) and the cookbook's roofline turns into time per step.

A forward of T new tokens in N sequences (at most L new and S cached-plus-new tokens each), with R rows of logits
and activations of `act_bytes`, on TP > 1 ranks; every rank contributes:
- all_reduce: T x hidden for the embedding (vocabulary-parallel), each KDA and MLA output projection and each dense
  MLP's down projection; per MoE layer T x hidden, or with a latent MoE T x expert_dim plus, in the same call, the
  shared experts' T x hidden; per indexer layer the N x L x S fp32 partial scores. Expert parallelism changes none
  of it: routed partials join the same all-reduce (no all-to-all dispatch).
- all_gather: R x ceil(vocab / TP) fp32 logits.
Under DP attention (dp_attention_traffic) attention, the embedding and the logits move over a DP group's TP / DP
ranks (attention: the group's own tokens), and each attention layer all-gathers the groups' outputs across them.
Between pipeline stages (pp_traffic), each rank of a stage sends the next stage's rank in its place the residual
stream entering that stage's first layer (with AttnRes, every block summary finished so far plus the partial sum),
T x hidden each; the last stage's first TP rank sends rank 0 the R x vocab fp32 logits.
With kestrel's decode context parallelism (kestrel.layers.dcp; `kestrel_dcp_traffic`), per MLA layer:
dcp_all_gather of the absorbed queries (T x H/TP x 576), with the indexer its queries (T x Hi/TP x D) and fp32
head weights, and the fp32 scores of the positions the rank holds (N x L x ceil(S / DCP)); dcp_all_reduce of the
partial softmaxes' fp32 maxima, weights and latent outputs over the DCP group's heads (N x L x H', twice, and
N x L x H' x 512, H' = DCP x H/TP), and with DCP < TP the indexer's local scores over the ranks holding the same
positions (N x L x ceil(S / DCP)); the indexer's scores then leave the TP all-reduce. `dcp_traffic` is the
analytic count of SGLang's exchange (queries all-gathered over the DCP group, partial outputs with their
log-sum-exp reduce-scattered back), which the cookbook uses.
With the all-to-all MoE (a2a_traffic; kestrel.layers.expert_dispatch), a token's stream stays with its DP group:
attention, the embedding, dense MLPs and shared experts move over the group's TP / DP ranks for the group's own
tokens, the routed experts' rows travel only between a token's owner and the ranks holding its experts
(a2a_dispatch: the row and 8 k bytes of slot ids and weights per pair; a2a_combine: the returned row; a2a_counts:
8 bytes to every other rank per MoE layer), each MoE layer all-gathers the routed sums of the group's shares
(TP / DP > 1), and the forward ends with one dp_all_gather of the groups' hidden states. The pairs depend on the
routing: `expected_a2a_pairs` is their mean under uniform routing, what the cookbook's roofline uses.
A ring all-reduce moves 2 (n - 1) / n of its input per rank, an all-gather n - 1 parts, a reduce-scatter (n - 1) / n,
an all-to-all only the rows sent to other ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig

LOGIT_BYTES = 4
SCORE_BYTES = 4


@dataclass(frozen=True)
class Forward:
    """The shape of one forward: T tokens, N sequences, longest L new and S total tokens, R logit rows."""

    tokens: int
    sequences: int
    longest_new: int
    longest_total: int
    logit_rows: int

    @classmethod
    def decode(cls, batch: int, context: int) -> Forward:
        """One decode step of `batch` sequences that reach `context` tokens with this one."""
        return cls(batch, batch, 1, context, batch)

    @classmethod
    def prefill(cls, tokens: int) -> Forward:
        """One prompt of `tokens` tokens in one chunk, logits at its last position."""
        return cls(tokens, 1, tokens, tokens, 1)


def _moe_layers(config: ModelConfig) -> int:
    return sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))


def tp_traffic(config: ModelConfig, tp: int, forward: Forward, act_bytes: int, dcp: int = 1) -> dict[str, int]:
    """Bytes one rank contributes to each collective kind in one forward (see the module docstring)."""
    if tp == 1:
        return {"all_reduce": 0, "all_gather": 0}
    return _tp_traffic(config, tp, tp, forward, forward, act_bytes, dcp)


def dp_attention_traffic(config: ModelConfig, tp: int, dp: int, groups: list[Forward], mine: int,
                         act_bytes: int) -> dict[str, int]:
    """Bytes a rank of DP group `mine` contributes in one forward under DP attention, the DP groups' shares of the
    step being `groups`: the dense MLPs and MoE as tp_traffic over every group's tokens; the attention outputs
    and indexer scores of its own group, the embedding and logits of every group, over its DP group of tp / dp
    ranks; and per attention layer a dp_all_gather of the largest group's T x hidden (the attention outputs)."""
    whole = Forward(sum(g.tokens for g in groups), sum(g.sequences for g in groups),
                    max(g.longest_new for g in groups), max(g.longest_total for g in groups),
                    sum(g.logit_rows for g in groups))
    out = _tp_traffic(config, tp, tp // dp, whole, groups[mine], act_bytes, 1)
    attention_layers = len(config.kda_layers) + len(config.mla_layers)
    out["dp_all_gather"] = attention_layers * max(g.tokens for g in groups) * config.hidden_size * act_bytes
    return out


def _tp_traffic(config: ModelConfig, tp: int, attn_tp: int, whole: Forward, own: Forward, act_bytes: int,
                dcp: int) -> dict[str, int]:
    """all_reduce and all_gather bytes of one rank (tp > 1): the FFNs over `whole`'s tokens on tp ranks, attention over
    `own`'s on attn_tp ranks, the embedding and logits over `whole`'s on attn_tp ranks."""
    t, hidden = whole.tokens, config.hidden_size
    moe = _moe_layers(config)
    dense = config.num_hidden_layers - moe
    rows = dense * t * hidden + moe * t * moe_reduce_width(config)
    scores = logits = 0
    if attn_tp > 1:
        rows += ((len(config.kda_layers) + len(config.mla_layers)) * own.tokens + t) * hidden
        if config.has_indexer and dcp == 1:
            scores = len(config.mla_layers) * own.sequences * own.longest_new * own.longest_total * SCORE_BYTES
        logits = whole.logit_rows * -(-config.vocab_size // attn_tp) * LOGIT_BYTES
    return {"all_reduce": rows * act_bytes + scores, "all_gather": logits}


def moe_reduce_width(config: ModelConfig) -> int:
    """Values per token of a MoE layer's all-reduce: the latent routed sum and the shared experts' output (latent
    MoE), or the hidden output."""
    if config.routed_expert_hidden_size is None:
        return config.hidden_size
    return config.expert_dim + (config.hidden_size if config.num_shared_experts else 0)


def routed_width(config: ModelConfig) -> int:
    """Values of a routed expert's input row: the latent width of a latent MoE, else the hidden width."""
    return config.expert_dim if config.routed_expert_hidden_size is not None else config.hidden_size


def a2a_moe_traffic(config: ModelConfig, tp: int, act_bytes: int, pairs_sent: float,
                    pairs_returned: float) -> dict[str, float]:
    """The all-to-all collectives' bytes from one rank in one forward (module docstring): dispatch, combine and the
    row counts, given its pairs over all MoE layers."""
    width = routed_width(config) * act_bytes
    return {"a2a_dispatch": pairs_sent * (width + 8 * config.num_experts_per_token),
            "a2a_combine": pairs_returned * width, "a2a_counts": _moe_layers(config) * 8 * (tp - 1)}


def a2a_traffic(config: ModelConfig, tp: int, dp: int, groups: list[Forward], mine: int, act_bytes: int,
                pairs_sent: int, pairs_returned: int) -> dict[str, int]:
    """Bytes a rank of DP group `mine` contributes in one forward with the all-to-all MoE (module docstring), given
    the (token, destination rank) pairs it dispatched to other ranks and the rows it returned to them, over all MoE
    layers."""
    attn_tp, own, hidden = tp // dp, groups[mine], config.hidden_size
    moe = _moe_layers(config)
    out = a2a_moe_traffic(config, tp, act_bytes, pairs_sent, pairs_returned)
    if attn_tp > 1:
        # over the group: each layer's attention, the embedding, the dense MLPs and the MoE layers' shared experts
        ffns = config.num_hidden_layers - moe + (moe if config.num_shared_experts else 0)
        rows = (config.num_hidden_layers + 1 + ffns) * own.tokens * hidden
        scores = len(config.mla_layers) * own.sequences * own.longest_new * own.longest_total * SCORE_BYTES \
            if config.has_indexer else 0
        whole_rows = sum(g.logit_rows for g in groups)
        out["all_reduce"] = rows * act_bytes + scores
        out["all_gather"] = moe * -(-own.tokens // attn_tp) * routed_width(config) * act_bytes + \
            whole_rows * -(-config.vocab_size // attn_tp) * LOGIT_BYTES
    if dp > 1:
        out["dp_all_gather"] = max(g.tokens for g in groups) * hidden * act_bytes
    return out


def expected_a2a_pairs(config: ModelConfig, tp: int, ep: int, redundant: int = 0) -> float:
    """(token, destination rank) pairs per token and MoE layer that leave the token's owner, when the k experts are
    chosen uniformly: each of the ep groups holds (E + R) / ep slots, reached with probability
    1 - C(E - slots, k) / C(E, k) (redundant slots counted as further experts: an upper bound), and every rank of a
    reached group gets the row; the owner's own rank is reached with the same probability."""
    e, k = config.num_experts, config.num_experts_per_token
    slots = min(e, (e + redundant) // ep)
    reached = 1 - math.comb(e - slots, k) / math.comb(e, k)
    return (tp - 1) * reached


def pp_traffic(config: ModelConfig, next_layer: int | None, forward: Forward, act_bytes: int) -> dict[str, int]:
    """Bytes a rank sends the next pipeline stage, whose first layer is next_layer, in one forward; None: from the
    last stage's first TP rank, the logits to rank 0."""
    if next_layer is None:
        return {"logits": forward.logit_rows * config.vocab_size * LOGIT_BYTES}
    return {"stream": config.stream_width(next_layer) * forward.tokens * config.hidden_size * act_bytes}


def kestrel_dcp_traffic(config: ModelConfig, tp: int, dcp: int, forward: Forward,
                        act_bytes: int) -> dict[str, int]:
    """Bytes one rank contributes to kestrel's DCP collectives in one forward (module docstring)."""
    if dcp == 1:
        return {}
    layers, t, heads = len(config.mla_layers), forward.tokens, config.num_attention_heads // tp
    padded = forward.sequences * forward.longest_new          # query rows in the padded [N, L] layout
    gathered = t * heads * config.kv_cache_dim * act_bytes
    reduced = padded * dcp * heads * (2 + config.kv_lora_rank) * 4
    if config.has_indexer:
        held = -(-forward.longest_total // dcp)
        gathered += t * config.index_n_heads // tp * (config.index_head_dim * act_bytes + 4) + \
            padded * held * SCORE_BYTES
        reduced += padded * held * SCORE_BYTES if tp > dcp else 0
    return {"dcp_all_gather": layers * gathered, "dcp_all_reduce": layers * reduced}


def dcp_traffic(config: ModelConfig, tp: int, dcp: int, forward: Forward, act_bytes: int) -> dict[str, int]:
    """SGLang's exchange, analytic (the cookbook's roofline; kestrel's own is kestrel_dcp_traffic): per MLA layer,
    this rank's heads' absorbed queries all-gathered over the DCP group, and the group's heads' partial latent
    outputs with an fp32 log-sum-exp each reduce-scattered back."""
    if dcp == 1:
        return {}
    heads = config.num_attention_heads // tp
    layers, t = len(config.mla_layers), forward.tokens
    queries = layers * t * heads * (config.kv_lora_rank + config.qk_rope_head_dim) * act_bytes
    outputs = layers * t * heads * dcp * (config.kv_lora_rank * act_bytes + 4)
    return {"dcp_all_gather": queries, "dcp_reduce_scatter": outputs}


def wire_bytes(kind: str, contributed: int, ranks: int) -> float:
    """Bytes a rank sends over the wire for `contributed` input bytes of collective `kind` in a ring of `ranks`."""
    if ranks == 1:
        return 0.0
    if kind.startswith("a2a_"):          # counted as the rows sent to other ranks
        return float(contributed)
    if kind.endswith("all_reduce"):
        return 2 * (ranks - 1) / ranks * contributed
    if kind.endswith("all_gather"):
        return (ranks - 1) * contributed
    return (ranks - 1) / ranks * contributed


def comm_seconds(traffic: dict[str, int], ranks: dict[str, int], bandwidth: float) -> float:
    """Time to move every collective of `traffic` (kind -> contributed bytes), kind k in a ring of ranks[k], at
    `bandwidth` bytes/s per rank."""
    return sum(wire_bytes(kind, n, ranks[kind]) for kind, n in traffic.items()) / bandwidth
