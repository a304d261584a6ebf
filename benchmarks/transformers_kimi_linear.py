"""transformers' Kimi-Linear modeling module on its torch path, for baselines.

With fla importable, transformers routes KDA to fla's Triton kernels (which cannot run on a CPU); the choice is
made when the module is imported, so fla is hidden while it is (re)imported.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

import torch


def load() -> ModuleType:
    """transformers.models.kimi_linear.modeling_kimi_linear, imported with fla hidden."""
    hidden = {name: module for name, module in sys.modules.items() if name == "fla" or name.startswith("fla.")}
    for name in [n for n in sys.modules if n.startswith("transformers.models.kimi_linear")]:
        del sys.modules[name]
    sys.modules["fla"] = None
    try:
        return importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)


def closest_model(text: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """A random-weight KimiLinearForCausalLM (fp32, train mode) with the closest configuration to a K3-style
    text_config that transformers can express: the same vocabulary, widths, layer pattern, heads, latents, experts
    and dense first layer, but no AttnRes, experts at the hidden size instead of a latent space, SwiGLU instead of
    SiTU, Kimi-Linear's unbounded decay gate and low-rank output gate, no indexer and no MTP layer."""
    modeling = load()
    linear = text["linear_attn_config"]
    config = modeling.KimiLinearConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
        moe_intermediate_size=text["moe_intermediate_size"], num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_attention_heads"],
        kv_lora_rank=text["kv_lora_rank"], q_lora_rank=text["q_lora_rank"],
        qk_nope_head_dim=text["qk_nope_head_dim"], qk_rope_head_dim=text["qk_rope_head_dim"],
        v_head_dim=text["v_head_dim"], num_local_experts=text["num_experts"],
        num_experts_per_tok=text["num_experts_per_token"], n_shared_experts=text["num_shared_experts"],
        routed_scaling_factor=1.0, pad_token_id=text["pad_token_id"], bos_token_id=text["bos_token_id"],
        eos_token_id=text["eos_token_id"],
        linear_attn_config={k: linear[k] for k in ("num_heads", "head_dim", "short_conv_kernel_size", "kda_layers",
                                                   "full_attn_layers")})
    torch.manual_seed(seed)
    return modeling.KimiLinearForCausalLM(config).train()
