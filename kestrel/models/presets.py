"""Tiny configs of each family member, in their published schemas: every architectural feature at toy size.

Tests build random checkpoints from them; `kestrel random-model` writes one for trying the stack end to end.
"""

from __future__ import annotations

import copy
from typing import Any

from ..config import MXFP4_QUANTIZATION_CONFIG


def _kimi_linear() -> dict[str, Any]:
    """Kimi-Linear-48B-A3B's schema: plain residuals, unbounded decay gate, low-rank KDA output gate, SwiGLU MoE."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
        "linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32,
        "intermediate_size": 96, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
        "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
    }


def _k3_text() -> dict[str, Any]:
    """K3's text_config: AttnRes, lower-bounded gate, full-rank KDA gate, gated MLA, latent SiTU MoE, MXFP4."""
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                               "use_full_rank_gate": True, "gate_lower_bound": -5.0,
                               "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6]},
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
        "intermediate_size": 96, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "moe_renormalize": True,
        "routed_scaling_factor": 1.0, "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "max_position_embeddings": 4096, "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
        "quantization_config": copy.deepcopy(MXFP4_QUANTIZATION_CONFIG),
    }


def _k3() -> dict[str, Any]:
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
            "text_config": _k3_text()}


def _k31() -> dict[str, Any]:
    """K3.1 Pro: K3 plus a lightning indexer (top-k 4, so selection is sparse past 4 tokens) and one MTP layer."""
    text = _k3_text()
    text["num_nextn_predict_layers"] = 1
    text["dsa_config"] = {"index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "index_rope_head_dim": 0,
                          "dsa_layers": [4, 6]}
    return {"architectures": ["KimiK31ForConditionalGeneration"], "model_type": "kimi_k3",
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
            "text_config": text}


PRESETS = {"kimi-linear-tiny": _kimi_linear, "k3-tiny": _k3, "k3.1-tiny": _k31}


def tiny_config(name: str) -> dict[str, Any]:
    """A fresh raw config.json dict of the preset `name` (one of PRESETS)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}.")
    return PRESETS[name]()
