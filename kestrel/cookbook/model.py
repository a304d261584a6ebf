"""What the planner needs to know about a model: its config, parameter counts, and where its weight bytes sit.

A rank's share of every tensor comes from the engine's sharding rules (kestrel.distributed.sharding: the table that
shapes each rank's model and drives its loader), evaluated for the heaviest rank of a planned layout; so a plan's
weights per rank are what kestrel's ranks load. Plans of SGLang's runtime take its known differences
(`sglang_splits`). For the report, bytes are also classified:
- `experts`: routed experts, split by expert (EP) and by intermediate width (the rest of the TP group).
- `attention`: KDA and MLA projections split by heads over the attention-TP group (tp / dp), the indexer's query
  and weight projections included (SGLang replicates those).
- `dense`: the dense first-layer MLP and the shared experts, split over the TP group.
- `vocab`: the embedding table and the LM head, split by vocabulary over the attention-TP group.
- `replicated`: every rank holds a copy: norms, AttnRes mixers, the router, the latent-MoE projections (they act
  on the full-width latent outside the expert bank), the MLA down-projections and the indexer's key projection.
Each byte also belongs to one layer (or to the first or last pipeline stage), so pipeline stages can be summed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType

import torch

from ..config import PUBLISHED_CONFIGS, ModelConfig, load_config, parse_config
from ..distributed.sharding import Split, split_numel, splits_of
from ..layers.cache import kv_bytes_per_token, state_bytes_per_slot
from ..models.checkpoint import build_model
from ..models.inspect import inspect_config
from ..models.presets import PRESETS, tiny_config
from .calculator import replayssm_ring_bytes_per_layer
from .first_rank import FirstRank

EXPERTS, ATTENTION, DENSE, VOCAB, REPLICATED = "experts", "attention", "dense", "vocab", "replicated"
SHARDINGS = (EXPERTS, ATTENTION, DENSE, VOCAB, REPLICATED)
FIRST, LAST = -1, -2
"""Pseudo layer indices: weights that live on the first (embedding) or last (head, final norms) pipeline stage."""

_REPLICATED_ATTENTION = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "f_a_proj", "o_norm",
                         "indexer.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
SGLANG_REPLICATED = re.compile(r"\.self_attn\.indexer\.")
"""Tensors kestrel splits but SGLang's runtime replicates: the DSA indexer's projections (as in DeepSeek-V3.2's
reference model, every rank scores all indexer heads)."""


def sglang_splits(name: str) -> tuple[Split, ...]:
    """SGLang's splits of tensor `name`: kestrel's, but SGLANG_REPLICATED replicated and packed experts split on any
    row (kestrel keeps whole MXFP4 blocks per rank)."""
    if SGLANG_REPLICATED.search(name):
        return ()
    return tuple(dataclasses.replace(split, unit=1) for split in splits_of(name))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}
SSM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DSA_QUANT_BLOCK = 128
"""SGLang's DSATokenToKVPool.quant_block_size: one fp32 scale per 128 fp8 values."""


def model_choices() -> list[str]:
    return [*PUBLISHED_CONFIGS, *PRESETS]


def resolve_config(name: str) -> ModelConfig:
    """A published model (k3, k3.1-pro, kimi-linear-48b), a tiny preset, or a config.json / model folder."""
    if name in PRESETS:
        return parse_config(tiny_config(name))
    return load_config(name)


def classify(name: str) -> str:
    """The sharding class of the state-dict tensor `name` (see the module docstring)."""
    if ".experts." in name:
        return EXPERTS
    if "embed_tokens" in name or name == "lm_head.weight":
        return VOCAB
    if ".shared_experts." in name or re.search(r"\.mlp\.(gate|up|down)_proj\.", name):
        return DENSE
    if ".self_attn." in name and not any(part in name for part in _REPLICATED_ATTENTION):
        return ATTENTION
    return REPLICATED


def _layer_of(name: str) -> int:
    match = _LAYER.match(name)
    if match:
        return int(match.group(1))
    return FIRST if "embed_tokens" in name else LAST


@dataclass(frozen=True)
class TensorFacts:
    """One weight tensor: where it sits, its sharding class and rules, its full shape and element size."""

    layer: int                   # or FIRST / LAST
    sharding: str
    splits: tuple[Split, ...]    # the engine's sharding rule for it (() when replicated)
    sglang_splits: tuple[Split, ...]    # SGLang's (see sglang_splits)
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def _selected(layer: int, layers: range | None, first: bool, last: bool) -> bool:
    return (layer == FIRST and first) or (layer == LAST and last) or (layer >= 0 and (layers is None or
                                                                                       layer in layers))


@dataclass(frozen=True, eq=False)
class ModelFacts:
    """A model's config and byte accounting, independent of any layout. Compared and hashed by identity (one per
    model and dtype, see model_facts), so its methods can memoize."""

    name: str
    dtype: str                                 # the weights' and activations' dtype (bf16, fp32): DTYPES
    config: ModelConfig
    total_params: int
    active_params: int
    tensors: tuple[TensorFacts, ...]           # every weight in the checkpoint's formats (a tied head once)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def attention_heads(self) -> tuple[int, int]:
        """(MLA heads, KDA heads): the attention-TP size must divide both."""
        return self.config.num_attention_heads, self.config.kda_num_heads

    @cache
    def bytes_by_sharding(self, layers: range | None = None, first: bool = True,
                          last: bool = True) -> MappingProxyType[str, int]:
        """Checkpoint bytes per sharding class, of the given layers (all when None) and the first/last extras."""
        totals = dict.fromkeys(SHARDINGS, 0)
        for t in self.tensors:
            if _selected(t.layer, layers, first, last):
                totals[t.sharding] += t.nbytes
        return MappingProxyType(totals)

    @cache
    def _groups(self, layers: range | None, first: bool, last: bool,
                mtp: bool) -> tuple[tuple[TensorFacts, int], ...]:
        """The selected tensors (and the MTP layers when `mtp`), alike ones counted together (layers repeat the same
        shapes)."""
        counts: dict[TensorFacts, int] = {}
        for t in self.tensors:
            if _selected(t.layer, layers, first, last) or (mtp and t.layer >= self.num_layers):
                key = dataclasses.replace(t, layer=0)
                counts[key] = counts.get(key, 0) + 1
        return tuple(counts.items())

    @cache
    def rank_bytes(self, rank: FirstRank, layers: range | None = None, first: bool = True,
                   last: bool = True) -> MappingProxyType[str, int]:
        """Bytes per sharding class that `rank` holds of the given layers and first/last extras, by the engine's
        sharding rules (or SGLang's variant of them, when the rank is SGLang's). kestrel's last stage also holds the
        MTP layers (its engine loads them); SGLang loads them only for its own drafter."""
        totals = dict.fromkeys(SHARDINGS, 0)
        for t, count in self._groups(layers, first, last, last and not rank.sglang):
            splits = t.sglang_splits if rank.sglang else t.splits
            totals[t.sharding] += count * split_numel(splits, t.shape, rank) * t.itemsize
        return MappingProxyType(totals)

    def embedding_bytes(self, rank: FirstRank) -> int:
        """The rank's share of the embedding table (decode reads a row per token of it, so it does not stream it)."""
        return self.rank_bytes(rank, range(0), first=True, last=False)[VOCAB]

    @cache
    def state_bytes_per_slot(self, ssm: str, layers: range | None = None) -> int:
        """KDA recurrent (ssm dtype) + conv (activation dtype) state of one sequence over `layers` (all when None)."""
        full = state_bytes_per_slot(self.config, DTYPES[self.dtype], SSM_DTYPES[ssm])
        kda = self.config.kda_layers
        return full * sum(1 for i in kda if layers is None or i in layers) // len(kda) if kda else 0

    @cache
    def replay_ring_bytes_per_slot(self, record_len: int, layers: range | None = None) -> int:
        """SGLang's ReplaySSM ring of one state slot over the KDA `layers` (all when None), rings of `record_len`
        steps in the activation dtype (calculator.replayssm_ring_bytes_per_layer)."""
        per_layer = replayssm_ring_bytes_per_layer(self.config.kda_num_heads, self.config.kda_head_dim, record_len,
                                                   DTYPES[self.dtype].itemsize)
        return per_layer * sum(1 for i in self.config.kda_layers if layers is None or i in layers)

    @cache
    def conv_window_bytes_per_request(self, width: int, layers: range | None = None) -> int:
        """The conv verify windows one running request holds under speculation over the KDA `layers` (all when None):
        SGLang's intermediate_conv_window, `width` verified tokens deep, each a copy of the conv state (K - 1 columns
        of q, k and v in the activation dtype; KDA keeps the dense layout, KimiLinearCacheParams)."""
        config = self.config
        per_token = (config.conv_kernel_size - 1) * 3 * config.kda_num_heads * config.kda_head_dim \
            * DTYPES[self.dtype].itemsize
        return width * per_token * sum(1 for i in config.kda_layers if layers is None or i in layers)

    def _mla_layers_in(self, layers: range | None) -> int:
        return sum(1 for i in self.config.mla_layers if layers is None or i in layers)

    @cache
    def latent_bytes_per_token(self, kv: str, layers: range | None = None, row_scales: bool = False) -> int:
        """MLA latent cache (576 values per layer for K3) of one token over `layers` (all when None)."""
        return _latent_bytes_per_layer(self.config, kv, row_scales) * self._mla_layers_in(layers)

    @cache
    def index_key_bytes_per_token(self, kv: str, layers: range | None = None, row_scales: bool = False) -> int:
        """Lightning-indexer keys of one token over `layers` (0 without an indexer)."""
        if not self.config.has_indexer:
            return 0
        return _index_key_bytes_per_layer(self.config, kv, row_scales) * self._mla_layers_in(layers)

    @cache
    def kv_bytes_per_token(self, kv: str, layers: range | None = None, row_scales: bool = False) -> int:
        """Everything the decoder caches per token over `layers` (all when None): latents plus indexer keys. A
        drafter's pages are counted apart (calculator.draft_kv_bytes_per_token), as SGLang counts them."""
        return (self.latent_bytes_per_token(kv, layers, row_scales)
                + self.index_key_bytes_per_token(kv, layers, row_scales))


def _scale_bytes(values: int) -> int:
    """fp32 scales of one fp8 row in blocks of 128 (SGLang's DSA quant_block_size)."""
    return -(-values // DSA_QUANT_BLOCK) * 4


def _kestrel_bytes_per_layer(config: ModelConfig, kv: str) -> tuple[int, int]:
    """(latent, indexer key) bytes of one token in one MLA layer as kestrel.layers.cache stores them."""
    latents = kv_bytes_per_token(dataclasses.replace(config, index_topk=0), KV_DTYPES[kv])
    layers = len(config.mla_layers)
    return latents // layers, (kv_bytes_per_token(config, KV_DTYPES[kv]) - latents) // layers


def _latent_bytes_per_layer(config: ModelConfig, kv: str, row_scales: bool) -> int:
    """One token's latent in one MLA layer.

    kestrel's layout (`row_scales`): the latent in the KV dtype, fp8 with a 4-byte scale (kestrel.layers.cache).
    SGLang's: a model without an indexer uses MLATokenToKVPool (576 values, fp8 with per-tensor scales: one byte
    each); a model with one is a DSA model, whose pool is DSATokenToKVPool with the row of SGLang's
    calculate_mla_kv_cache_dim: in fp8, 512 latent bytes + their fp32 scales per 128 + the rope part in bf16
    (512 + 16 + 64 x 2 = 656 B for K3.1 Pro), else 576 values in the KV dtype.
    """
    if row_scales:
        return _kestrel_bytes_per_layer(config, kv)[0]
    if kv != "fp8":
        return config.kv_cache_dim * KV_DTYPES[kv].itemsize
    if not config.has_indexer:
        return config.kv_cache_dim
    return config.kv_lora_rank + _scale_bytes(config.kv_lora_rank) + config.qk_rope_head_dim * 2


def _index_key_bytes_per_layer(config: ModelConfig, kv: str, row_scales: bool) -> int:
    """One token's indexer key in one DSA layer: kestrel's in the KV dtype (fp8 with a 4-byte scale); SGLang's
    DSATokenToKVPool keeps them in fp8 with an fp32 scale per 128 whatever the KV dtype (128 + 4 = 132 B)."""
    if row_scales:
        return _kestrel_bytes_per_layer(config, kv)[1]
    return config.index_head_dim + _scale_bytes(config.index_head_dim)


@cache
def model_facts(name: str, dtype: str = "bf16") -> ModelFacts:
    """Byte accounting of `name` (see resolve_config) with unquantized weights in `dtype`; builds the model on the
    meta device, once per process and dtype."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown model dtype {dtype!r}; choose one of: {', '.join(DTYPES)}.")
    config = resolve_config(name)
    report = inspect_config(config)
    model = build_model(config, DTYPES[dtype], device="meta")
    tensors = tuple(TensorFacts(_layer_of(tensor_name), classify(tensor_name), splits_of(tensor_name),
                                sglang_splits(tensor_name),
                                tuple(tensor.shape), tensor.element_size())
                    for tensor_name, tensor in model.state_dict(keep_vars=True).items()
                    if not (tensor_name == "lm_head.weight" and config.tie_word_embeddings))
    return ModelFacts(name=name, dtype=dtype, config=config, total_params=report.total_params,
                      active_params=report.active_params, tensors=tensors)
