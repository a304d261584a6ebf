"""kestrel's lightning indexer against transformers' DeepSeek-V3.2 indexer (no RoPE) on identical weights,
and sparse MLA against dense MLA when top-k covers the whole context."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

from helpers import tiny_model
from kestrel.config import parse_config
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.mla import GatedMLA, LightningIndexer
from kestrel.models.presets import tiny_config
from kestrel.ops import topk_mask

T, TOPK = 48, 9


def test_selection_matches_transformers_deepseek_v32_indexer():
    raw = tiny_config("k3.1-tiny")
    raw["text_config"].update(rms_norm_eps=1e-6)
    raw["text_config"]["dsa_config"].update(index_n_heads=4, index_topk=TOPK, index_k_norm_bias=True)
    config = parse_config(raw)
    ours = LightningIndexer(config)
    theirs = DeepseekV32Indexer(DeepseekV32Config(
        hidden_size=config.hidden_size, q_lora_rank=config.q_lora_rank, index_n_heads=4,
        index_head_dim=config.index_head_dim, index_topk=TOPK, qk_rope_head_dim=0), layer_idx=0)
    torch.manual_seed(0)
    for p in ours.parameters():
        p.data.normal_()
    theirs.load_state_dict(ours.state_dict())

    x, q_latent = torch.randn(T, config.hidden_size), torch.randn(T, config.q_lora_rank)
    batch = ForwardBatch.build([T])
    causal = torch.ones(1, T, T, dtype=torch.bool).tril()
    scores = ours.scores(x, q_latent, ours.keys(x)[None], batch, causal)
    selected = topk_mask(scores, causal, TOPK)[0]

    empty = torch.zeros(1, T, 0)
    indices = theirs(x[None], q_latent[None], (empty, empty), causal, None).long()[0]
    expected = torch.zeros(T, T, dtype=torch.bool).scatter_(1, indices, True) & causal[0]
    top = scores[0].sort(dim=-1, descending=True).values
    clear = (top[:, TOPK - 1] > top[:, TOPK]) | (torch.arange(T) < TOPK)   # rows without a tie at the cut
    assert clear.sum() > T * 0.8
    assert torch.equal(selected[clear], expected[clear])


def test_sparse_mla_equals_dense_mla_when_topk_covers_the_context():
    sparse, _ = tiny_model("k3.1-tiny", dsa_config={"index_n_heads": 2, "index_head_dim": 16, "index_topk": T,
                                                    "dsa_layers": [4, 6]})
    dense_config = parse_config({**tiny_config("k3-tiny")})
    layer = sparse.model.layers[3].self_attn
    assert isinstance(layer, GatedMLA) and layer.indexer is not None
    dense = GatedMLA(dense_config, 0, with_indexer=False)
    dense.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("indexer.")})
    x = torch.randn(T, dense_config.hidden_size)
    batch = ForwardBatch.build([T])
    with torch.no_grad():
        torch.testing.assert_close(layer(x, batch), dense(x, batch))
        layer.indexer.topk = 4
        assert not torch.allclose(layer(x, batch), dense(x, batch), atol=1e-3)


def test_sparse_mla_well_above_topk_equals_the_masked_dense_formulation():
    """A 320-token context with top-8 and repeated tokens (equal index scores, ties broken by position): the layer
    (the indexer's selection block by block, attention over each query's 8 latents) equals the whole-context
    formulation it replaces (scores over all causal keys, topk_mask, attention masked to them: what the layer still
    runs when asked for its scores), in float32 and against that formulation in float64."""
    model, _ = tiny_model("k3.1-tiny", dsa_config={"index_n_heads": 2, "index_head_dim": 16, "index_topk": 8,
                                                   "dsa_layers": [4, 6]})
    layer = model.model.layers[3].self_attn
    gen = torch.Generator().manual_seed(0)
    t = 320
    x = torch.randn(40, layer.q_a_proj.weight.shape[1], generator=gen)[torch.randint(0, 40, (t,), generator=gen)]
    batch = ForwardBatch.build([t])
    with torch.no_grad():
        scores = []
        dense = layer(x, batch, index_scores_out=scores)
        kth = scores[0].topk(8).values[..., -1:]
        assert ((scores[0] == kth).sum(-1) > 1).sum() > t // 4              # ties at the cut in many rows
        torch.testing.assert_close(layer(x, batch), dense, atol=1e-5, rtol=1e-5)
        exact = layer.double()(x.double(), batch, index_scores_out=[]).float()
        layer.float()
        torch.testing.assert_close(layer(x, batch), exact, atol=1e-4, rtol=1e-4)
