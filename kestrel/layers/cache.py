"""Cache storage the layers read and write: fixed-size KDA state per slot, and paged MLA latents and indexer keys.

These are plain containers; deciding which slot and which pages a request owns is the engine's job. A sequence's
KDA state lives in one slot (recurrent state plus the conv inputs the short convolution still needs); its MLA
cache lives in pages of `page_size` tokens, addressed through the batch's page table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig


@dataclass
class KDAState:
    """One KDA layer's state pool."""

    conv: torch.Tensor        # [slots, kernel-1, 3*H*K]: the last kernel-1 q/k/v projections (pre-conv)
    recurrent: torch.Tensor   # [slots, H, K, V], fp32 by default


@dataclass
class MLAPages:
    """One MLA layer's paged cache, flattened to rows (row = page * page_size + offset)."""

    latent: torch.Tensor              # [pages * page_size, kv_lora_rank + qk_rope_head_dim]
    index_keys: torch.Tensor | None   # [pages * page_size, index_head_dim] when the layer has an indexer


@dataclass
class HybridCache:
    """All caches of one model: `kda[i]` for the i-th KDA layer, `mla[j]` for the j-th MLA layer (MTP last)."""

    kda: list[KDAState]
    mla: list[MLAPages]
    page_size: int

    @classmethod
    def allocate(cls, config: ModelConfig, num_slots: int, num_pages: int, page_size: int,
                 dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> HybridCache:
        """Zeroed storage for num_slots sequences' KDA state and num_pages pages of MLA cache."""
        hk = config.kda_num_heads * config.kda_head_dim
        kda = [KDAState(
            conv=torch.zeros(num_slots, config.conv_kernel_size - 1, 3 * hk, dtype=dtype, device=device),
            recurrent=torch.zeros(num_slots, config.kda_num_heads, config.kda_head_dim, config.kda_head_dim,
                                  dtype=state_dtype, device=device),
        ) for _ in config.kda_layers]
        rows = num_pages * page_size
        num_mla = len(config.mla_layers) + config.num_nextn_predict_layers
        mla = [MLAPages(
            latent=torch.zeros(rows, config.kv_cache_dim, dtype=dtype, device=device),
            index_keys=(torch.zeros(rows, config.index_head_dim, dtype=dtype, device=device)
                        if config.has_indexer and j < len(config.mla_layers) else None),
        ) for j in range(num_mla)]
        return cls(kda=kda, mla=mla, page_size=page_size)
