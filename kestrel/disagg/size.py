"""What one PD handoff weighs: the bytes a prefill instance sends a decode instance for a prompt (the planner's and
the cookbook's number for how much interconnect a PD layout needs; the TCP backend sends exactly this plus a JSON
header)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..layers.cache import kv_bytes_per_token, state_bytes_per_slot


def handoff_bytes(config: ModelConfig, prompt_tokens: int, page_size: int, dtype: torch.dtype,
                  ssm_dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None) -> int:
    """Tensor bytes of one sequence's handoff: the latents (+ indexer keys, + FP8 scales) of every MLA layer for the
    prompt's pages (whole pages of page_size tokens), plus every KDA layer's conv (dtype) and recurrent (ssm_dtype)
    state, which does not grow with the prompt. kv_dtype: the paged cache's (None: dtype)."""
    pages = -(-prompt_tokens // page_size)
    return (pages * page_size * kv_bytes_per_token(config, kv_dtype or dtype)
            + state_bytes_per_slot(config, dtype, ssm_dtype))
