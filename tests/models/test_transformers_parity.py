"""A Kimi-Linear checkpoint written by transformers' own KimiLinearForCausalLM loads in kestrel with equal logits."""

from __future__ import annotations

import importlib
import sys

import torch

from kestrel.layers.batch import ForwardBatch
from kestrel.models.checkpoint import load_model

LENGTHS = [5, 64, 97, 1]
ATOL = 1e-4   # fp32 end to end; observed differences are up to 1.5e-5 on logits of std 0.8


def transformers_kimi_linear():
    """transformers' kimi_linear modeling module, imported with fla hidden so that it takes its torch path
    (with fla importable it routes KDA to fla's Triton kernels, which cannot run on a CPU)."""
    saved = sys.modules.get("fla")
    sys.modules["fla"] = None
    for name in [n for n in sys.modules if n.startswith("transformers.models.kimi_linear")]:
        del sys.modules[name]
    try:
        return importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    finally:
        if saved is None:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = saved


def random_reference_model():
    modeling = transformers_kimi_linear()
    config = modeling.KimiLinearConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, routed_scaling_factor=2.446,
        linear_attn_config={"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4]})
    torch.manual_seed(0)
    model = modeling.KimiLinearForCausalLM(config).eval()
    with torch.no_grad():   # weights large enough that every path moves the logits
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                continue
            p.normal_(0, 0.5 if "e_score_correction_bias" in name else 0.1)
    return model


def test_transformers_checkpoint_loads_with_equal_logits(tmp_path):
    reference = random_reference_model()
    reference.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)

    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 300, (n,), generator=gen) for n in LENGTHS]
    with torch.no_grad():
        ours = model.compute_logits(model(torch.cat(seqs), ForwardBatch.build(LENGTHS))).split(LENGTHS)
        for seq, got in zip(seqs, ours):
            expected = reference(seq[None]).logits[0].float()
            assert expected.std() > 0.5
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
