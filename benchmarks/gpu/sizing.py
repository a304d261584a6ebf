"""How much of the Kimi-Linear-48B shape the end-to-end section builds: the largest configuration whose estimated
bytes fit the device's free memory with headroom, so that a lent GPU's run is not spent on an out-of-memory error.

Configurations, largest first: the model as published (bf16 routed experts, 98.24 GB of weights: an H200's ~139 GiB
holds it, one H100's ~78 GiB does not); its routed experts in MXFP4 (4.25 bits a weight, as the K3 family ships them;
the Triton MoE kernel dequantizes them inside its GEMM), 29.05 GB; then MXFP4 with the decoder cut to its first N
layers, the most that fit (reported as a cut). A configuration fits when its weights (as `kestrel inspect` counts
them), its caches and WORKSPACE_BYTES take at most USABLE_FRACTION of the free memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kestrel.config import ModelConfig
from kestrel.layers.cache import kv_bytes_per_token, state_bytes_per_slot
from kestrel.models.inspect import inspect_config

GIB = 2**30
WORKSPACE_BYTES = 12 * GIB
"""Activations (a prefill of 4 x 2,048 tokens), CUDA graphs' pools, Triton's workspaces."""
USABLE_FRACTION = 0.9
"""Of the free memory: the rest is the allocator's fragmentation and the estimate's error."""


@dataclass(frozen=True)
class Sizing:
    """One configuration of the model (bf16 activations and caches) and its estimated bytes on the device."""

    config: ModelConfig
    full_layers: int              # the published model's decoder layers
    parameters: int
    weight_bytes: int
    cache_bytes: int              # state slots and KV pages as the section allocates them

    @property
    def experts(self) -> str:
        return "mxfp4" if self.config.experts_mxfp4 else "bf16"

    @property
    def layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def estimated_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + WORKSPACE_BYTES

    def fits(self, free_bytes: int) -> bool:
        return self.estimated_bytes <= USABLE_FRACTION * free_bytes

    def describe(self) -> str:
        layers = (f"all {self.full_layers} layers" if self.layers == self.full_layers else
                  f"its first {self.layers} of {self.full_layers} layers (cut to fit the device)")
        return f"{self.experts} routed experts, {layers}"

    def as_dict(self) -> dict[str, Any]:
        return dict(experts=self.experts, layers=self.layers, full_layers=self.full_layers,
                    cut=self.layers < self.full_layers, described=self.describe(),
                    weight_gb=round(self.weight_bytes / 1e9, 2), cache_gb=round(self.cache_bytes / 1e9, 2),
                    estimated_gb=round(self.estimated_bytes / 1e9, 2))


def size(config: ModelConfig, mxfp4: bool, layers: int, slots: int, cache_tokens: int) -> Sizing:
    """`config` with MXFP4 or bf16 routed experts and its first `layers` decoder layers, and its bytes with `slots`
    state slots and `cache_tokens` KV rows."""
    variant = dataclasses.replace(config, experts_mxfp4=mxfp4, num_hidden_layers=layers,
                                  layer_types=config.layer_types[:layers])
    report = inspect_config(variant)
    cache = (slots * state_bytes_per_slot(variant, torch.bfloat16, torch.float32)
             + cache_tokens * kv_bytes_per_token(variant, torch.bfloat16))
    return Sizing(variant, config.num_hidden_layers, report.total_params, sum(report.weight_bytes.values()), cache)


def candidates(config: ModelConfig, slots: int, cache_tokens: int) -> Iterator[Sizing]:
    """Largest first: bf16 experts, MXFP4 experts, then MXFP4 with fewer layers (down to the first MLA layer)."""
    full = config.num_hidden_layers
    yield size(config, False, full, slots, cache_tokens)
    for layers in range(full, config.mla_layers[0], -1):
        yield size(config, True, layers, slots, cache_tokens)


def choose(config: ModelConfig, free_bytes: int, slots: int, cache_tokens: int) -> Sizing:
    """The largest candidate that fits `free_bytes`; a ValueError when not even the smallest does."""
    for option in candidates(config, slots, cache_tokens):
        if option.fits(free_bytes):
            return option
    raise ValueError(f"no configuration of the model fits: the smallest ({option.describe()}) needs an estimated "
                     f"{option.estimated_bytes / GIB:.1f} GiB, more than {USABLE_FRACTION:.0%} of the "
                     f"{free_bytes / GIB:.1f} GiB free.")
