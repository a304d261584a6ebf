"""What a config implies before any weight is read: parameter counts, active parameters, memory, cache sizes.

Everything is computed from a model built on the meta device (no storage), so it is exact for the module
layout kestrel loads and costs a couple of seconds even for the 2.8T-parameter K3.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..config import ModelConfig
from ..layers.cache import kv_bytes_per_token, state_bytes_per_slot
from .checkpoint import build_model

MXFP4 = "mxfp4"


@dataclass(frozen=True)
class ModelReport:
    """Parameter and memory accounting of a text model (vision towers are not counted)."""

    architecture: str
    layers: dict[str, int]               # kda, mla, indexer, moe, dense, mtp
    total_params: int                    # every text parameter; MXFP4 weights count 2 per packed byte
    active_params: int                   # per token: all but the embedding table and MTP, top-k routed experts
    embedding_params: int
    routed_expert_params: int            # all routed experts
    mtp_params: int
    weight_bytes: dict[str, int]         # storage by format: bfloat16, float32, mxfp4 (values and scales)
    kv_bytes_per_token: int              # MLA latents (+ indexer keys) of the decoder's MLA layers, model dtype
    state_bytes_per_sequence: int        # KDA recurrent state (fp32) + conv state (model dtype), all KDA layers

    def as_dict(self) -> dict:
        return asdict(self)


def inspect_config(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> ModelReport:
    model = build_model(config, dtype, device="meta")
    mtp_prefixes = tuple(f"model.layers.{i}." for i in range(config.num_hidden_layers, len(model.model.layers)))
    total = embedding = routed = mtp = 0
    weight_bytes: dict[str, int] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        fmt = MXFP4 if tensor.dtype == torch.uint8 else str(tensor.dtype).removeprefix("torch.")
        weight_bytes[fmt] = weight_bytes.get(fmt, 0) + tensor.numel() * tensor.element_size()
        if name.endswith("_scale"):
            continue
        count = tensor.numel() * (2 if name.endswith("_packed") else 1)
        total += count
        if name.startswith(mtp_prefixes):
            mtp += count
        elif "embed_tokens" in name:
            embedding += count
        elif ".experts." in name:
            routed += count
    routed_share = config.num_experts_per_token / config.num_experts if config.num_experts else 0.0
    active = total - embedding - mtp - routed + round(routed * routed_share)
    return ModelReport(
        architecture=config.architecture,
        layers=_layer_counts(config),
        total_params=total,
        active_params=active,
        embedding_params=embedding,
        routed_expert_params=routed,
        mtp_params=mtp,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token(config, dtype),
        state_bytes_per_sequence=state_bytes_per_slot(config, dtype, torch.float32),
    )


def _moe_layers(config: ModelConfig) -> int:
    return sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))


def _layer_counts(config: ModelConfig) -> dict[str, int]:
    moe = _moe_layers(config)
    return {"kda": len(config.kda_layers), "mla": len(config.mla_layers),
            "indexer": len(config.mla_layers) if config.has_indexer else 0,
            "moe": moe, "dense": config.num_hidden_layers - moe, "mtp": config.num_nextn_predict_layers}
