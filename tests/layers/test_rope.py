"""kestrel.layers.rope against transformers' RoPE initialisation (the reference a published draft was trained
with): inverse frequencies and the cos/sin factor of plain RoPE and of YaRN's variants, and the rotation itself
against HF's apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from kestrel.layers.rope import rope_from_config
from helpers import hf_rope

HEAD_DIM, THETA = 36, 1000.0
YARNS = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 16,
     "mscale": 0.707, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "truncate": False,
     "attention_factor": 1.3},
    {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_slow": 2},     # the old key
]


@pytest.mark.parametrize("scaling", [{}, {"rope_type": "default"}, *YARNS])
def test_frequencies_and_factor_are_transformers(scaling):
    rope = rope_from_config(HEAD_DIM, THETA, scaling)
    inv_freq, factor = hf_rope(HEAD_DIM, THETA, scaling)
    assert torch.equal(rope.inv_freq, inv_freq)
    assert rope.attention_factor == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("scaling", [{}, YARNS[1]])
def test_rotation_is_hfs(scaling):
    """Queries and keys [P, heads, head_dim] at positions up to 100,000 (YaRN's scaled range); angles in float32,
    as transformers computes them."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, HEAD_DIM, generator=gen)
    positions = torch.tensor([0, 1, 17, 4095, 65536, 100_000])
    inv_freq, factor = hf_rope(HEAD_DIM, THETA, scaling)
    freqs = torch.outer(positions.float(), inv_freq.float())            # in float32, as Qwen3RotaryEmbedding
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos() * factor, emb.sin() * factor
    heads_first = x.transpose(0, 1)[None]                                          # [1, heads, P, head_dim]
    expected, _ = apply_rotary_pos_emb(heads_first, heads_first, cos[None], sin[None])
    got = rope_from_config(HEAD_DIM, THETA, scaling).rotate(x, positions)
    torch.testing.assert_close(got, expected[0].transpose(0, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "longrope", "factor": 4.0}, "RoPE scaling 'longrope' is not supported"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0},
     "YaRN RoPE scaling with low_freq_factor is not supported"),
])
def test_refuses_what_it_does_not_compute(scaling, message):
    with pytest.raises(ValueError, match=message):
        rope_from_config(HEAD_DIM, THETA, scaling)
