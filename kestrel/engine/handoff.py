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
    indexer keys and FP8 scales where the cache has them), as device_ops saves parts; and, from a speculative
    instance, its drafter's context in the same pages ("{p}.mtp.{k}.latent" or "{p}.dflash.{k}.latent",
    HandoffLayout).
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


Spec = dict[str, tuple[torch.Size, torch.dtype]]

CONTEXT_KINDS = ("mtp", "dflash")
"""What a handoff's draft context holds: the MTP layers' latents (NEXTN), or a published DFlash draft's rows."""


@dataclass(frozen=True)
class HandoffLayout:
    """One process's layout of a handoff: cache (a meta-device HybridCache of one process's shapes) holds the
    target's first target_layers MLA layers, then any paged layers of a drafter, whose rows travel as draft context
    named "{part}.{context}.{k}.{field}". The contract between instances is the rest (KDA state, target MLA pages);
    draft context is loaded where both sides have the same, and recomputed where only the decode side has it."""

    cache: HybridCache
    target_layers: int
    context: str | None          # one of CONTEXT_KINDS, or None without a drafter's paged layers

    def spec(self, num_pages: int) -> Spec:
        """Name -> (shape, dtype) of this layout's handoff tensors for a sequence of num_pages pages."""
        slot = entry_spec(self.cache, [("slot", 0)])
        page = {name.split(".", 1)[1]: spec for name, spec in entry_spec(self.cache, [("page", 0)]).items()}
        return self.named({**slot, **{f"{p}.{name}": spec for p in range(1, num_pages + 1)
                                      for name, spec in page.items()}})

    def named(self, entry: dict) -> dict:
        """A saved entry (cache names, device_ops) under handoff names: MLA layers past the target's are context."""
        named = {}
        for name, value in entry.items():
            part, kind, index, field = name.split(".", 3)
            if kind == "mla" and int(index) >= self.target_layers:
                name = f"{part}.{self.context}.{int(index) - self.target_layers}.{field}"
            named[name] = value
        return named

    def entry(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Handoff tensors of this layout under the cache names they load into (the inverse of named)."""
        entry = {}
        for name, t in tensors.items():
            part, kind, index, field = name.split(".", 3)
            if kind in CONTEXT_KINDS:
                name = f"{part}.mla.{self.target_layers + int(index)}.{field}"
            entry[name] = t
        return entry


def split_context(named: dict) -> tuple[dict, dict]:
    """(the contract's items, the draft context's items) of a dict keyed by handoff names."""
    context = {name: value for name, value in named.items() if name.split(".")[1] in CONTEXT_KINDS}
    return {name: value for name, value in named.items() if name not in context}, context
