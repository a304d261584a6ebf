"""The bundled model's architecture: every Kimi K3.1 feature, sized for training on two CPU cores.

Six layers in K3's pattern (full attention every 4th layer and the last: KDA KDA KDA MLA KDA MLA), AttnRes blocks
of two layers, KDA with the lower-bounded decay gate and the full-rank output gate, gated NoPE MLA with a lightning
indexer keeping 64 of the 256 training positions, a dense first layer, then latent SiTU MoE layers (32 routed
experts of which 2 per token, one shared expert, experts in a 96-d latent space, stored as MXFP4) and one MTP layer.
"""

from __future__ import annotations

import copy
from typing import Any

from kestrel.config import MXFP4_QUANTIZATION_CONFIG

SEQ_LEN = 256
"""Training context (tokens after [BOS]); the indexer keeps INDEX_TOPK of them."""
INDEX_TOPK = 64
VOCAB_SIZE = 4096
MAX_POSITIONS = 2048
"""Longest sequence the config (and tokenizer config) advertise: NoPE attention and KDA have no position limit, but
training never saw more than SEQ_LEN tokens."""


def text_config(special: dict[str, int]) -> dict[str, Any]:
    """The text_config of the K3.1 schema (dense experts; `tiny_config(..., mxfp4=True)` adds MXFP4)."""
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": VOCAB_SIZE, "hidden_size": 192, "num_hidden_layers": 6,
        "linear_attn_config": {"num_heads": 4, "head_dim": 48, "short_conv_kernel_size": 4,
                               "use_full_rank_gate": True, "gate_lower_bound": -5.0,
                               "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6]},
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 128,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32, "mla_use_nope": True,
        "mla_use_output_gate": True,
        "dsa_config": {"index_n_heads": 4, "index_head_dim": 32, "index_topk": INDEX_TOPK, "index_rope_head_dim": 0,
                       "dsa_layers": [4, 6]},
        "intermediate_size": 384, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": 32, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 96,
        "routed_expert_hidden_size": 96, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "moe_renormalize": True,
        "routed_scaling_factor": 1.0, "num_expert_group": 1, "topk_group": 1,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 2, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-5,
        "max_position_embeddings": MAX_POSITIONS, "tie_word_embeddings": False,
        "bos_token_id": special["[BOS]"], "eos_token_id": special["<|end_of_msg|>"], "pad_token_id": special["[PAD]"],
    }


def tiny_config(special: dict[str, int], mxfp4: bool) -> dict[str, Any]:
    """The whole config.json (KimiK31ForConditionalGeneration); with mxfp4, routed experts are MXFP4."""
    text = text_config(special)
    if mxfp4:
        text["quantization_config"] = copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)
    return {"architectures": ["KimiK31ForConditionalGeneration"], "model_type": "kimi_k3",
            "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
            "pad_token_id": text["pad_token_id"], "tie_word_embeddings": False, "text_config": text}
