"""Cache storage the layers read and write: fixed-size KDA state per slot, and paged MLA latents and indexer keys.

These are plain containers; deciding which slot and which pages a request owns is the engine's job. A sequence's
KDA state lives in one slot (recurrent state plus the conv inputs the short convolution still needs); its MLA
cache lives in pages of `page_size` tokens, addressed through the batch's page table.

Storage is left uninitialised (memory is only touched as it is used): the layers never let a value influence a
result before it was written, since a fresh sequence ignores its slot and attention ignores unwritten rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..ops.torch.kda_decode import TokenStates

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class KDAState:
    """One KDA layer's state pool."""

    conv: torch.Tensor        # [slots, kernel-1, 3*H*K]: the last kernel-1 q/k/v projections (pre-conv)
    recurrent: torch.Tensor   # [slots, H, K, V], fp32 by default
    token_states: TokenStates | None = None   # the last speculative verification's state after every token

    def keep(self, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        """Commit the verification's states after tokens [N] (flat indices into its tokens) to slots [N]."""
        self.conv[slots] = self.token_states.conv[tokens].to(self.conv.dtype)
        self.recurrent[slots] = self.token_states.recurrent[tokens].to(self.recurrent.dtype)


@dataclass
class PagedRows:
    """Per-token vectors in pages, flattened to rows (row = page * page_size + offset).

    Stored as is, or as FP8 E4M3 with one fp32 scale per row (amax / 448), dequantized on read.
    """

    values: torch.Tensor                 # [pages * page_size, D]
    scales: torch.Tensor | None = None   # [pages * page_size] when values are FP8

    @classmethod
    def allocate(cls, rows: int, dim: int, dtype: torch.dtype, device: torch.device | str) -> PagedRows:
        values = torch.empty(rows, dim, dtype=dtype, device=device)
        scales = torch.empty(rows, dtype=torch.float32, device=device) if dtype == FP8 else None
        return cls(values, scales)

    def write(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Store x [R, D] at rows [R]."""
        x = x.detach()
        if self.scales is None:
            self.values[rows] = x.to(self.values.dtype)
            return
        scale = x.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX
        self.values[rows] = (x.float() / scale.unsqueeze(-1)).to(FP8)
        self.scales[rows] = scale

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The vectors at rows [...] -> [..., D] in dtype."""
        if self.scales is None:
            return self.values[rows].to(dtype)
        return (self.values[rows].float() * self.scales[rows].unsqueeze(-1)).to(dtype)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows src [R] to rows dst [R] (copy-on-write of a shared page)."""
        self.values[dst] = self.values[src]
        if self.scales is not None:
            self.scales[dst] = self.scales[src]


@dataclass
class MLAPages:
    """One MLA layer's paged cache: 512 + 64 latent values per token, and the indexer's keys when it has one."""

    latent: PagedRows
    index_keys: PagedRows | None


@dataclass
class HybridCache:
    """All caches of one model: `kda[i]` for the i-th KDA layer, `mla[j]` for the j-th MLA layer (then any MTP
    layers allocated with pages, then a DFlash draft's layers). With decode context parallelism over dcp_size
    ranks, a page of page_size tokens holds only this rank's page_size / dcp_size of them (kestrel.layers.dcp)."""

    kda: list[KDAState]
    mla: list[MLAPages]
    page_size: int
    dcp_size: int = 1

    @property
    def rows_per_page(self) -> int:
        """Cache rows of one page on this rank."""
        return self.page_size // self.dcp_size

    @classmethod
    def allocate(cls, config: ModelConfig, num_slots: int, num_pages: int, page_size: int,
                 dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype = torch.float32,
                 kv_dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                 mtp_layers: int = 0, dcp_size: int = 1, draft_layers: int = 0, draft_width: int = 0) -> HybridCache:
        """Storage (uninitialised) for num_slots sequences' KDA state and num_pages pages of MLA cache.

        dtype: the conv state's (the model's activations); state_dtype: the recurrent state's; kv_dtype: the paged
        cache's (default dtype; torch.float8_e4m3fn stores FP8 with a scale per token). mtp_layers: how many of the
        model's MTP layers get pages too (after the decoder's); serving runs none, only a drafter would. dcp_size:
        the ranks one page's tokens are spread over. draft_layers: pages of rows of draft_width values for a DFlash
        draft's layers (kestrel.models.dflash_draft), after those.
        """
        _check_mtp_layers(config, mtp_layers)
        hk = config.kda_num_heads * config.kda_head_dim
        kda = [KDAState(
            conv=torch.empty(num_slots, config.conv_kernel_size - 1, 3 * hk, dtype=dtype, device=device),
            recurrent=torch.empty(num_slots, config.kda_num_heads, config.kda_head_dim, config.kda_head_dim,
                                  dtype=state_dtype, device=device),
        ) for _ in config.kda_layers]
        rows, kv_dtype = num_pages * (page_size // dcp_size), kv_dtype or dtype
        mla = [MLAPages(
            latent=PagedRows.allocate(rows, config.kv_cache_dim, kv_dtype, device),
            index_keys=(PagedRows.allocate(rows, config.index_head_dim, kv_dtype, device)
                        if config.has_indexer and j < len(config.mla_layers) else None),
        ) for j in range(len(config.mla_layers) + mtp_layers)]
        mla += [MLAPages(PagedRows.allocate(rows, draft_width, kv_dtype, device), None)
                for _ in range(draft_layers)]
        return cls(kda=kda, mla=mla, page_size=page_size, dcp_size=dcp_size)


def state_bytes_per_slot(config: ModelConfig, dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
    """Recurrent state (ssm_dtype) plus conv state (the model dtype) of every KDA layer, for one sequence."""
    h, d = config.kda_num_heads, config.kda_head_dim
    per_layer = h * d * d * ssm_dtype.itemsize + (config.conv_kernel_size - 1) * 3 * h * d * dtype.itemsize
    return len(config.kda_layers) * per_layer


def kv_bytes_per_token(config: ModelConfig, kv_dtype: torch.dtype, mtp_layers: int = 0) -> int:
    """Latents (+ indexer keys) of every MLA layer, and latents of the first mtp_layers MTP layers (none when
    serving), for one token; FP8 adds a 4-byte scale to each vector. What HybridCache.allocate stores per row."""
    _check_mtp_layers(config, mtp_layers)
    scale = 4 if kv_dtype == FP8 else 0
    keys = config.index_head_dim * kv_dtype.itemsize + scale if config.has_indexer else 0
    latent = row_bytes(config.kv_cache_dim, kv_dtype)
    return len(config.mla_layers) * (latent + keys) + mtp_layers * latent


def row_bytes(width: int, kv_dtype: torch.dtype) -> int:
    """One cached row of width values (in FP8 with its 4-byte scale)."""
    return width * kv_dtype.itemsize + (4 if kv_dtype == FP8 else 0)


def _check_mtp_layers(config: ModelConfig, mtp_layers: int) -> None:
    if not 0 <= mtp_layers <= config.num_nextn_predict_layers:
        raise ValueError(f"mtp_layers is {mtp_layers}, but the model has {config.num_nextn_predict_layers} MTP "
                         "layers; cache between 0 and that many.")
