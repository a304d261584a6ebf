"""K3-specific math against float64 oracles written out from ../shared/reference/model-spec.md.

Each oracle below is the spec's formula typed out in float64 from the module's own weights (never through kestrel's
helper functions); the kestrel module runs in float32 on the same inputs. Spec sections: SiTU-GLU (3), the full-rank
KDA output gate inside the whole KDA layer (4.1-4.3), the gated NoPE MLA (5.1; K3.1's sparse form through the paged
cache against transformers' DeepSeek-V3.2 indexer and the masked formula), the latent MoE with its norm (6, with
MXFP4 experts decoded as in 7.2), and the AttnRes residual stream of a whole model (3).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import tiny_model
from kestrel.config import KDA, MLA
from kestrel.layers.activation import glu_activation
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.layers.kda import KimiDeltaAttention
from kestrel.layers.mla import ABSORBED, PLAIN, GatedMLA
from kestrel.layers.moe import MoE
from kestrel.models.kimi import KimiForCausalLM

SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0       # activation_situ_beta / activation_situ_linear_beta (spec 2.1)
KDA_GATE_LOWER_BOUND = -5.0                     # linear_attn_config.gate_lower_bound (spec 2.1, 4.2)
L2_NORM_EPS = 1e-6                              # fla l2norm (spec 4.1)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]   # spec 7.1
SEQ_LENS = [7, 4]                               # two packed sequences: causality must not cross between them
REL = 1e-5
MODEL_REL = 1e-4                                # a whole model: see test_attn_res_model_forward_matches_the_spec
ORACLE_ROWS = 1024                              # queries per block of mla_oracle's [H, rows, T] scores


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, rel: float = REL) -> None:
    """Every element of the float32 result within rel * max|expected| of the float64 oracle."""
    assert actual.shape == expected.shape
    error = (actual.double() - expected).abs().max().item()
    assert error <= rel * expected.abs().max().item(), f"max error {error:.3g} vs scale {expected.abs().max():.3g}"


def f64(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().double()


def linear(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    """x @ W^T in float64 (the family's projections have no bias)."""
    return x @ f64(module.weight).t()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * f64(weight)


def situ_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Spec 3: beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta), beta = 4, linear_beta = 25."""
    return (SITU_BETA * torch.tanh(gate / SITU_BETA) * torch.sigmoid(gate)
            * SITU_LINEAR_BETA * torch.tanh(up / SITU_LINEAR_BETA))


def gated_mlp(x: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    """down_proj(SiTU-GLU(gate_proj x, up_proj x)): the dense layer and the shared experts."""
    return linear(situ_glu(linear(x, mlp.gate_proj), linear(x, mlp.up_proj)), mlp.down_proj)


def randomize_norm_weights(model: nn.Module, seed: int) -> None:
    """Norm weights of 1 +- 0.3 instead of init's ones, so a norm that forgets its weight (or uses another's) shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))


def random_input(rows: int, width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * scale


def packed_batch() -> tuple[ForwardBatch, list[slice]]:
    batch = ForwardBatch.build(SEQ_LENS)
    bounds = batch.cu_seqlens.tolist()
    return batch, [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def layer_of(model: KimiForCausalLM, kind: type) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, kind))


# ---------------------------------------------------------------------------------------------- SiTU (spec 3)

def test_situ_activation_matches_the_spec_formula():
    """Oracle: SiTU-GLU in float64, over gates and ups wide enough that both tanh branches saturate."""
    model, _ = tiny_model("k3-tiny")
    act = glu_activation(model.config)
    gate, up = random_input(64, 96, seed=1, scale=12.0), random_input(64, 96, seed=2, scale=60.0)
    assert_matches(act(gate, up), situ_glu(gate.double(), up.double()))


@torch.no_grad()
def test_dense_situ_mlp_matches_the_spec_formula():
    """Oracle: layer 0's dense SiTU-GLU MLP (gate_proj, up_proj, down_proj) in float64."""
    model, _ = tiny_model("k3-tiny")
    mlp = model.model.layers[0].mlp
    x = random_input(11, model.config.hidden_size, seed=3, scale=4.0)
    assert_matches(mlp(x), gated_mlp(x.double(), mlp))


# ---------------------------------------------------------------------------------------------- KDA (spec 4)

def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the causal depthwise conv y_t[c] = sum_i w[c, 0, i] x_{t-W+1+i}[c], zero left padding (one sequence)."""
    width = weight.shape[-1]
    padded = torch.cat([x.new_zeros(width - 1, x.shape[1]), x])
    w = f64(weight)[:, 0]                                                  # [C, W]
    y = torch.stack([(padded[t:t + width].t() * w).sum(-1) for t in range(x.shape[0])])
    return torch.nn.functional.silu(y)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)


def kda_oracle(layer: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """Spec 4.1-4.3 for one sequence x [T, hidden] (float64): conv, L2 norm, the lower-bounded decay gate, the
    delta-rule recurrence, then RMSNorm per head times sigmoid of the full-rank g_proj gate, then o_proj."""
    steps, heads, dim = x.shape[0], layer.num_heads, layer.head_dim
    q = l2norm(causal_conv_silu(linear(x, layer.q_proj), layer.q_conv1d.weight).view(steps, heads, dim))
    k = l2norm(causal_conv_silu(linear(x, layer.k_proj), layer.k_conv1d.weight).view(steps, heads, dim))
    v = causal_conv_silu(linear(x, layer.v_proj), layer.v_conv1d.weight).view(steps, heads, dim)
    q = q * dim ** -0.5
    graw = linear(linear(x, layer.f_a_proj), layer.f_b_proj).view(steps, heads, dim)
    rate = f64(layer.A_log).exp().view(heads, 1)
    g = KDA_GATE_LOWER_BOUND * torch.sigmoid(rate * (graw + f64(layer.dt_bias).view(heads, dim)))
    beta = torch.sigmoid(linear(x, layer.b_proj))                          # [T, H]
    state = x.new_zeros(heads, dim, dim)                                   # S [H, K, V]
    outputs = []
    for t in range(steps):
        state = state * g[t].exp().unsqueeze(-1)
        residual = v[t] - torch.einsum("hk,hkv->hv", k[t], state)
        state = state + k[t].unsqueeze(-1) * (beta[t].unsqueeze(-1) * residual).unsqueeze(-2)
        outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    o = torch.stack(outputs)                                               # [T, H, V]
    out_gate = torch.sigmoid(linear(x, layer.g_proj).view(steps, heads, dim))
    o = rms_norm(o, layer.o_norm.weight, layer.o_norm.eps) * out_gate
    return linear(o.reshape(steps, heads * dim), layer.o_proj)


@torch.no_grad()
def test_kda_layer_with_full_rank_output_gate_matches_the_spec():
    """Oracle: the whole K3 KDA layer written out in float64 per sequence, its output gated by
    sigmoid(g_proj(x)) after the per-head RMSNorm (spec 4.1)."""
    model, _ = tiny_model("k3-tiny")
    randomize_norm_weights(model, seed=4)
    layer = layer_of(model, KimiDeltaAttention)
    assert hasattr(layer, "g_proj") and layer.g_proj.weight.shape == (layer.num_heads * layer.head_dim,
                                                                     model.config.hidden_size)
    batch, sequences = packed_batch()
    x = random_input(batch.num_tokens, model.config.hidden_size, seed=5)
    expected = torch.cat([kda_oracle(layer, x[s].double()) for s in sequences])
    assert_matches(layer(x, batch), expected)


# ---------------------------------------------------------------------------------------------- MLA (spec 5.1)

def mla_oracle(layer: GatedMLA, x: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Spec 5.1 for one sequence x [T, hidden] (float64): NoPE MLA with the head-shared key part, causal softmax
    attention scaled by qk_head_dim^-0.5 (masked further to `allowed` [T, T] when given: a sparse layer's selection),
    and the output gate sigmoid(g_proj x) applied before o_proj.

    The q_a/kv_a RMSNorm eps is the module's own: the spec leaves it unresolved (1e-5 or 1e-6, section 11.5)."""
    steps, heads = x.shape[0], layer.num_heads
    nope, shared, v_dim, latent = layer.nope_dim, layer.rope_dim, layer.v_dim, layer.latent_dim
    c_q = rms_norm(linear(x, layer.q_a_proj), layer.q_a_layernorm.weight, layer.q_a_layernorm.eps)
    q = linear(c_q, layer.q_b_proj).view(steps, heads, nope + shared)
    ckv = linear(x, layer.kv_a_proj_with_mqa)
    c_kv = rms_norm(ckv[:, :latent], layer.kv_a_layernorm.weight, layer.kv_a_layernorm.eps)
    kv = linear(c_kv, layer.kv_b_proj).view(steps, heads, nope + v_dim)
    k = torch.cat([kv[..., :nope], ckv[:, latent:].unsqueeze(1).expand(steps, heads, shared)], dim=-1)
    v = kv[..., nope:]
    causal = torch.ones(steps, steps, dtype=torch.bool).tril()
    if allowed is not None:
        causal = causal & allowed
    blocks = []
    for rows in (slice(r, r + ORACLE_ROWS) for r in range(0, steps, ORACLE_ROWS)):
        scores = torch.einsum("thd,shd->hts", q[rows], k) * (nope + shared) ** -0.5
        blocks.append(torch.einsum("hts,shv->thv", scores.masked_fill(~causal[rows], float("-inf")).softmax(-1), v))
    attn = torch.cat(blocks)
    gated = attn.reshape(steps, heads * v_dim) * torch.sigmoid(linear(x, layer.g_proj))
    return linear(gated, layer.o_proj)


@pytest.mark.parametrize("form", [PLAIN, ABSORBED])
@torch.no_grad()
def test_gated_mla_matches_the_spec(form: str):
    """Oracle: K3's gated NoPE MLA written out in float64 per sequence (spec 5.1), against both of kestrel's forms."""
    model, _ = tiny_model("k3-tiny")
    randomize_norm_weights(model, seed=6)
    layer = layer_of(model, GatedMLA)
    assert layer.indexer is None and hasattr(layer, "g_proj")
    layer.form = form
    batch, sequences = packed_batch()
    x = random_input(batch.num_tokens, model.config.hidden_size, seed=7)
    expected = torch.cat([mla_oracle(layer, x[s].double()) for s in sequences])
    assert_matches(layer(x, batch), expected)


SPARSE_CONTEXT, SPARSE_TOPK, TIE_GAP = 96, 8, 1e-5
"""The sparse test's context (12x index_topk), and the least gap between a query's 8th and 9th index scores for
which float32 surely selects what float64 selects: their scores differ by at most 9.5e-7 here (measured)."""


@torch.no_grad()
def test_sparse_mla_through_the_paged_cache_matches_the_deepseek_v32_formulation():
    """K3.1's sparse MLA far above index_topk (96 tokens, top-8), run as the engine runs it: a 40-token prefill
    chunk into a paged cache (pages out of order), a 30-token chunk over that cached prefix (what a prefix hit
    runs), then 26 decode steps. Oracle, float64: transformers' DeepSeek-V3.2 indexer, on the layer's indexer
    weights, picks each query's top-8 of its causal keys, and spec 5.1's attention is masked to them. Queries whose
    8th and 9th scores lie within TIE_GAP are left out of the comparison: a rounding may swap those, and exact ties
    (the indexer's ReLU makes many scores 0) the formulation leaves open (transformers' topk breaks them
    arbitrarily, kestrel by position; the gaps are read from the layer's own indexer run in float64). 75 of the 96
    queries remain."""
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    model, _ = tiny_model("k3.1-tiny", dsa_config={"index_n_heads": 2, "index_head_dim": 16,
                                                   "index_topk": SPARSE_TOPK, "dsa_layers": [4, 6],
                                                   "index_k_norm_bias": True})
    randomize_norm_weights(model, seed=8)
    layer = next(m for m in model.modules() if isinstance(m, GatedMLA) and m.indexer is not None)
    config, t, page = model.config, SPARSE_CONTEXT, 4
    x = random_input(t, config.hidden_size, seed=9)
    cache = HybridCache.allocate(config, num_slots=1, num_pages=t // page + 3, page_size=page, dtype=torch.float32)
    table = torch.randperm(t // page + 3, generator=torch.Generator().manual_seed(10))[:t // page].view(1, -1)
    outputs = []
    for start, length in [(0, 40), (40, 30)] + [(p, 1) for p in range(70, t)]:
        batch = ForwardBatch.build([length], [start], [0], table, page)
        outputs.append(layer(x[start:start + length], batch, cache))
    got = torch.cat(outputs)

    theirs = DeepseekV32Indexer(DeepseekV32Config(
        hidden_size=config.hidden_size, q_lora_rank=config.q_lora_rank, index_n_heads=2, index_head_dim=16,
        index_topk=SPARSE_TOPK, qk_rope_head_dim=0), layer_idx=0).double()
    theirs.load_state_dict(layer.indexer.state_dict())
    x64 = x.double()
    c_q = rms_norm(linear(x64, layer.q_a_proj), layer.q_a_layernorm.weight, layer.q_a_layernorm.eps)
    causal = torch.ones(1, t, t, dtype=torch.bool).tril()
    empty = torch.zeros(1, t, 0, dtype=torch.float64)
    picked = theirs(x64[None], c_q[None], (empty, empty), causal, None).long()[0]
    allowed = torch.zeros(t, t, dtype=torch.bool).scatter_(1, picked, True)
    assert (allowed & causal[0]).sum(-1).max() == SPARSE_TOPK            # the cut binds: attention is sparse

    scores = layer.indexer.double().scores(x64, c_q, layer.indexer.keys(x64)[None], ForwardBatch.build([t]),
                                           causal)[0]
    layer.indexer.float()
    top = scores.masked_fill(~causal[0], float("-inf")).sort(dim=-1, descending=True).values
    clear = (top[:, SPARSE_TOPK - 1] - top[:, SPARSE_TOPK] > TIE_GAP) | (torch.arange(t) < SPARSE_TOPK)
    assert clear.sum() >= 0.75 * t
    assert_matches(got[clear], mla_oracle(layer, x64, allowed)[clear])


# ---------------------------------------------------------------------------------------------- latent MoE (spec 6)

def mxfp4_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Spec 7.2: W[o, 32g + i] = E2M1(code) * 2^(scale[o, g] - 127); low nibble = even column. float64."""
    lut = torch.tensor(E2M1, dtype=torch.float64)
    codes = torch.stack([packed.long() & 0xF, packed.long() >> 4], dim=-1).flatten(-2)
    return lut[codes] * torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=-1)


def moe_oracle(moe: MoE, x: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec 6 in float64: (output [T, hidden], selected experts [T, k]). Sigmoid router, top-k on score + bias,
    weights renormalized over the selected scores and scaled, routed experts (MXFP4) in the latent space, their
    weighted sum RMSNormed and projected up, plus the shared experts on the original x."""
    experts, top_k = moe.experts, moe.gate.top_k
    scores = torch.sigmoid(x @ f64(moe.gate.weight).t())
    selected = (scores + f64(moe.gate.e_score_correction_bias)).topk(top_k, dim=-1).indices
    weights = scores.gather(1, selected)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * scaling
    w1, w3, w2 = (mxfp4_weight(getattr(experts, f"{n}_packed"), getattr(experts, f"{n}_scale"))
                  for n in ("w1", "w3", "w2"))
    z = linear(x, moe.routed_expert_down_proj)
    y_latent = torch.zeros_like(z)
    for t in range(x.shape[0]):
        for slot in range(top_k):
            e = selected[t, slot]
            y_latent[t] += weights[t, slot] * (w2[e] @ situ_glu(w1[e] @ z[t], w3[e] @ z[t]))
    y = linear(rms_norm(y_latent, moe.routed_expert_norm.weight, moe.routed_expert_norm.eps),
               moe.routed_expert_up_proj)
    return y + gated_mlp(x, moe.shared_experts), selected


@pytest.mark.parametrize("scaling", [1.0, 2.5])
@torch.no_grad()
def test_latent_moe_matches_the_spec(scaling: float):
    """Oracle: K3's latent MoE written out in float64 (spec 6), with a selection bias big enough to change which
    experts win, at K3's routed_scaling_factor 1.0 and at another value."""
    model, _ = tiny_model("k3-tiny", routed_scaling_factor=scaling)
    randomize_norm_weights(model, seed=8)
    moe = layer_of(model, MoE)
    assert moe.latent and moe.experts.mxfp4 and model.config.num_shared_experts == 2
    assert moe.routed_expert_norm.eps == model.config.rms_norm_eps == 1e-5
    bias = moe.gate.e_score_correction_bias
    bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(9)) * 0.3)
    x = random_input(16, model.config.hidden_size, seed=10, scale=3.0)
    expected, selected = moe_oracle(moe, x.double(), scaling)
    unbiased = torch.sigmoid(x.double() @ f64(moe.gate.weight).t()).topk(moe.gate.top_k, dim=-1).indices
    assert not torch.equal(selected.sort(-1).values, unbiased.sort(-1).values), "the bias never changes selection"
    assert torch.equal(moe.gate(x)[0], selected)
    assert_matches(moe(x), expected)


# ---------------------------------------------------------------------------------------------- AttnRes (spec 3)

def attn_res_mix(sources: list[torch.Tensor], norm: nn.Module, proj: nn.Linear, eps: float) -> torch.Tensor:
    """Spec 3 `Mix`: s_i = sum_d RMSNorm(v_i)[d] norm_w[d] proj_w[d]; p = softmax_i(s); sum_i p_i v_i (raw v_i)."""
    logits = torch.stack([(rms_norm(v, norm.weight, eps) * f64(proj.weight[0])).sum(-1) for v in sources])
    probs = logits.softmax(0)
    return sum(p.unsqueeze(-1) * v for p, v in zip(probs, sources))


def spec_sublayers(layer: nn.Module, batch: ForwardBatch, config) -> tuple:
    """The float64 oracles of a decoder layer's attention and FFN (spec 4, 5.1, 6, 3) for one sequence."""
    attention = kda_oracle if isinstance(layer.self_attn, KimiDeltaAttention) else mla_oracle
    ffn = ((lambda x: moe_oracle(layer.ffn, x, config.routed_scaling_factor)[0]) if isinstance(layer.ffn, MoE)
           else (lambda x: gated_mlp(x, layer.ffn)))
    assert batch.num_seqs == 1
    return (lambda x: attention(layer.self_attn, x)), ffn


def kestrel_sublayers(layer: nn.Module, batch: ForwardBatch, config) -> tuple:
    """The decoder layer's own attention and FFN, run in float32 on float64 inputs."""
    return (lambda x: layer.self_attn(x.float(), batch).double()), (lambda x: layer.ffn(x.float()).double())


def attn_res_logits(model: KimiForCausalLM, input_ids: torch.Tensor, batch: ForwardBatch,
                    partials: dict[int, torch.Tensor] | None = None, sublayers=kestrel_sublayers) -> torch.Tensor:
    """Spec 3's top-level loop in float64: the block bank B, the running partial P, a snapshot every
    attn_res_block_size layers, the two mixes per layer and the output mix, then the final norm and lm_head.
    Each sublayer (attention, FFN) is `sublayers`' (kestrel's own, run in float32 on the oracle's normed input, or
    spec_sublayers: every sublayer a float64 oracle). partials, when given, receives P after every layer (what a
    forward hook on the layer sees in NeMo's K3 model)."""
    config, inner = model.config, model.model
    eps, block = config.rms_norm_eps, config.attn_res_block_size
    bank: list[torch.Tensor] = []
    partial = f64(inner.embed_tokens.weight)[input_ids]
    for index, layer in enumerate(inner.decoder_layers):
        h = partial if not bank else attn_res_mix(bank + [partial], layer.self_attention_res_norm,
                                                  layer.self_attention_res_proj, eps)
        if index % block == 0:
            bank.append(partial)
            partial = torch.zeros_like(partial)
        attention, ffn = sublayers(layer, batch, config)
        partial = partial + attention(rms_norm(h, layer.input_layernorm.weight, eps))
        m = attn_res_mix(bank + [partial], layer.mlp_res_norm, layer.mlp_res_proj, eps)
        partial = partial + ffn(rms_norm(m, layer.post_attention_layernorm.weight, eps))
        if partials is not None:
            partials[index] = partial
    hidden = attn_res_mix(bank + [partial], inner.output_attn_res_norm, inner.output_attn_res_proj, eps)
    return linear(rms_norm(hidden, inner.norm.weight, eps), model.lm_head)


@torch.no_grad()
def test_layer_outputs_are_what_nemo_hooks_see():
    """The layer outputs a DFlash draft reads (KimiTextModel.forward's features): with AttnRes, the running partial
    sum after each named layer (spec 3's loop above, in float64); without, the residual stream a forward hook on the
    layer sees. Asking for them leaves the hidden states as they were."""
    model, _ = tiny_model("k3.1-tiny")
    batch, _ = packed_batch()
    input_ids = torch.randint(0, model.config.vocab_size, (batch.num_tokens,),
                              generator=torch.Generator().manual_seed(13))
    plain = model(input_ids, batch)
    features = dict.fromkeys((4, 1))
    assert torch.equal(model.model(input_ids, batch, None, features), plain)
    partials: dict[int, torch.Tensor] = {}
    attn_res_logits(model, input_ids, batch, partials)
    assert_matches(features[4], partials[4], rel=MODEL_REL)
    assert_matches(features[1], partials[1], rel=MODEL_REL)

    linear_model, _ = tiny_model("kimi-linear-tiny")
    assert linear_model.config.attn_res_block_size is None
    hooked: dict[int, torch.Tensor] = {}
    for i in (0, 2):
        linear_model.model.layers[i].register_forward_hook(lambda m, a, o, i=i: hooked.__setitem__(i, o))
    features = dict.fromkeys((0, 2))
    linear_model.model(input_ids % linear_model.config.vocab_size, batch, None, features)
    assert torch.equal(features[0], hooked[0]) and torch.equal(features[2], hooked[2])


@pytest.mark.parametrize("preset", ["k3-tiny", "k3.1-tiny"])
@torch.no_grad()
def test_attn_res_model_forward_matches_the_spec(preset: str):
    """Oracle: a whole tiny model's residual stream recomputed in float64 by spec 3's loop (6 layers, blocks of 2,
    so the bank grows to 3 snapshots), compared on the logits.

    Tolerance: float32 rounding through six layers moves these logits by up to ~5e-5 of their scale, so the bound is
    1e-4; the AttnRes mistakes it guards against (a uniform mix, logits of unnormalised sources, mixing the normalised
    sources) move them by more than 1.0 of their scale.
    """
    model, _ = tiny_model(preset)
    randomize_norm_weights(model, seed=11)
    assert model.config.attn_res_block_size == 2 and model.config.layer_types == (KDA, KDA, KDA, MLA, KDA, MLA)
    batch, _ = packed_batch()
    input_ids = torch.randint(0, model.config.vocab_size, (batch.num_tokens,),
                              generator=torch.Generator().manual_seed(12))
    assert_matches(model.compute_logits(model(input_ids, batch)), attn_res_logits(model, input_ids, batch),
                   rel=MODEL_REL)


@torch.no_grad()
def test_whole_k3_model_with_every_sublayer_in_float64_matches_the_spec():
    """Oracle: spec 3's loop with every sublayer a float64 oracle too (KDA 4.1-4.3, MLA 5.1, latent MoE 6, the dense
    SiTU MLP), over one sequence; the same bound as with kestrel's sublayers."""
    model, _ = tiny_model("k3-tiny")
    randomize_norm_weights(model, seed=11)
    batch = ForwardBatch.build([11])
    input_ids = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(14))
    assert_matches(model.compute_logits(model(input_ids, batch)),
                   attn_res_logits(model, input_ids, batch, sublayers=spec_sublayers), rel=MODEL_REL)
