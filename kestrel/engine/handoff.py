"""A request handed from a prefill instance to a decode instance (PD disaggregation): its prompt, the first token
the prefill side sampled, and CPU copies of everything its caches hold after the prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.cache import HybridCache
from .cache.device_ops import Part, entry_spec
from .outputs import TokenLogprobs


@dataclass
class Handoff:
    """What a prefill instance sends a decode instance for one request.

    tensors: the sequence's KDA state (part 0: "0.kda.{i}.conv" [kernel-1, 3*H*K], "0.kda.{i}.recurrent"
    [H, K, V]) and its KV pages in order (parts 1..num_pages: "{p}.mla.{j}.latent" [page_size, D], plus the
    indexer keys and FP8 scales where the cache has them), as device_ops saves parts.
    """

    prompt_ids: list[int]
    first_token: int
    tensors: dict[str, torch.Tensor]
    num_pages: int
    first_logprobs: TokenLogprobs | None = None    # the first token's logprob entry, when the request asked for them
    generator_state: torch.Tensor | None = None    # a seeded request's generator after the first token (uint8)
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # per prompt token (None first), when asked for


def handoff_parts(slot: int, pages: list[int]) -> list[Part]:
    """The parts a handoff's tensors hold: the state slot, then the pages."""
    return [("slot", slot)] + [("page", page) for page in pages]


def handoff_spec(cache: HybridCache, num_pages: int) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name -> (shape, dtype) of a handoff's tensors for a sequence of num_pages pages in cache."""
    slot = entry_spec(cache, [("slot", 0)])
    page = {name.split(".", 1)[1]: spec for name, spec in entry_spec(cache, [("page", 0)]).items()}
    return {**slot, **{f"{p}.{name}": spec for p in range(1, num_pages + 1) for name, spec in page.items()}}
