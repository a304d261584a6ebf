"""Turns a memory budget into pool sizes: weights first, the rest split between KDA state slots and KV tokens.

SGLang's semantics: the budget is mem_fraction_static of the device's memory; the weights come off it; the rest
is divided so that state bytes : KV bytes = mamba_full_memory_ratio, unless max_mamba_cache_size fixes the slots;
max_total_tokens caps the KV pool.
Every running sequence holds one state slot, so the slots cap the concurrency (prefix-cache snapshots take only
free slots). With speculative decoding each running sequence also needs, while its draft is verified, the KDA
state after every verified token (draft tokens + 1 of them, recurrent in fp32: SGLang's extra state slots per
request); they come off the state share first.
The KV pool caches the decoder's MLA layers only: the MTP layers get pages when a drafter runs them (mtp_layers),
and so do a DFlash draft's layers, their rows of the target's context (draft_layers, counted as the draft's).
A STANDALONE draft model's caches mirror the pools (its state in every slot, its latents in every page), so its
state per slot and KV per token add to the target's, and each running sequence also keeps up to draft-tokens
copies of the draft's slot state to roll back to (`draft`).
With decode context parallelism (dcp_size ranks) a rank stores page_size / dcp_size tokens of each page.
A pipeline stage without KDA (or MLA) layers needs no state (or KV) memory: it puts no bound on that pool
(`UNBOUNDED`), and the stages then agree on the others' (engine.ranks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ...config import ModelConfig
from ...layers.cache import kv_bytes_per_token, row_bytes, state_bytes_per_slot
from ..args import EngineArgs


UNBOUNDED = 1 << 40
"""The slots (or pages) of a plan whose config has no KDA (or MLA) layers: any number fits."""


class MemoryPlanError(ValueError):
    """The budget cannot hold the model and at least one sequence."""


@dataclass(frozen=True)
class MemoryPlan:
    device_memory: int
    budget: int                   # device_memory * mem_fraction_static
    weight_bytes: int
    state_bytes_per_slot: int
    kv_bytes_per_token: int       # the decoder's MLA layers, plus mtp_layers MTP layers
    mtp_layers: int
    verify_tokens: int            # speculative decoding: tokens per verification whose states each running seq keeps
    token_state_bytes: int        # one such state (every KDA layer, recurrent in fp32)
    num_slots: int
    num_pages: int
    page_size: int
    max_running_requests: int
    context_length: int
    draft_state_bytes_per_slot: int = 0   # a STANDALONE draft model's share of state_bytes_per_slot
    draft_kv_bytes_per_token: int = 0     # ... and of kv_bytes_per_token (or a DFlash draft's context rows)
    dcp_size: int = 1                     # ranks each page's tokens are spread over (this rank stores 1 / dcp_size)
    dflash_layers: int = 0                # a DFlash draft's layers, whose context rows each token holds

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def state_pool_bytes(self) -> int:
        return self.num_slots * self.state_bytes_per_slot

    @property
    def kv_pool_bytes(self) -> int:
        """This rank's share of the pages."""
        return self.kv_tokens // self.dcp_size * self.kv_bytes_per_token

    @property
    def verify_bytes(self) -> int:
        """Reserved for speculative verification: every running sequence's per-token states."""
        return self.max_running_requests * self.verify_tokens * self.token_state_bytes

    def describe(self) -> str:
        """The start-up log block."""
        gib = 2**30
        mtp = f" (MTP layers: {self.mtp_layers})" if self.mtp_layers else ""
        return "\n".join([
            f"memory plan: {self.budget / gib:.2f} GiB of {self.device_memory / gib:.2f} GiB; "
            f"weights {self.weight_bytes / gib:.3f} GiB",
            f"  KV cache: {self.kv_bytes_per_token:,} B per token{mtp}, {self.kv_tokens:,} tokens in "
            f"{self.num_pages:,} pages of {self.page_size} ({self.kv_pool_bytes / gib:.3f} GiB"
            + (f" on this rank: 1/{self.dcp_size} of each page)" if self.dcp_size > 1 else ")")
            if self.kv_bytes_per_token else "  KV cache: none (no MLA layer)",
            f"  KDA state: {self.state_bytes_per_slot:,} B per slot, {self.num_slots:,} slots "
            f"({self.state_pool_bytes / gib:.3f} GiB)" if self.state_bytes_per_slot else "  KDA state: none (no KDA "
            "layer)",
            *([f"  draft model: {self.draft_state_bytes_per_slot:,} B of each slot (and {self.verify_tokens - 1} "
               f"roll-back copies per running request), {self.draft_kv_bytes_per_token:,} B of each token"]
              if not self.dflash_layers and (self.draft_state_bytes_per_slot or self.draft_kv_bytes_per_token)
              else []),
            *([f"  DFlash draft: {self.draft_kv_bytes_per_token:,} B of each token (the context rows of its "
               f"{self.dflash_layers} layers)"] if self.dflash_layers else []),
            *([f"  speculative verification: {self.verify_tokens} token states of {self.token_state_bytes:,} B per "
               f"running request ({self.verify_bytes / gib:.3f} GiB)"] if self.verify_tokens else []),
            f"  concurrency cap: {self.max_running_requests:,} running requests; context length "
            f"{self.context_length:,} tokens",
        ])


def device_memory(device: torch.device) -> int:
    """Total memory of the device: GPU memory on CUDA, physical RAM on the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_memory(config: ModelConfig, args: EngineArgs, weight_bytes: int, memory: int, dtype: torch.dtype,
                ssm_dtype: torch.dtype, kv_dtype: torch.dtype, mtp_layers: int = 0,
                draft: ModelConfig | None = None, draft_layers: int = 0, draft_width: int = 0) -> MemoryPlan:
    """Pool sizes for `memory` bytes of device memory (see the module docstring); mtp_layers: how many MTP
    layers the engine runs (a drafter's; 0 when serving plainly), whose latents the KV pool must hold too; draft:
    the config of a STANDALONE draft model (its weights in weight_bytes), whose caches mirror the pools;
    draft_layers: a DFlash draft's layers, whose context rows (of draft_width values) every page holds too."""
    fraction = args.mem_fraction_static or (0.85 if args.device.startswith("cuda") else 0.1)
    budget = int(memory * fraction)
    rest = budget - weight_bytes
    if rest <= 0:
        raise MemoryPlanError(f"the weights need {weight_bytes / 2**30:.2f} GiB but mem_fraction_static {fraction} "
                              f"of {memory / 2**30:.2f} GiB leaves only {budget / 2**30:.2f} GiB; raise "
                              "--mem-fraction-static or use a device with more memory.")
    draft_slot = 0 if draft is None else state_bytes_per_slot(draft, dtype, ssm_dtype)
    draft_token = ((0 if draft is None else kv_bytes_per_token(draft, kv_dtype))
                   + draft_layers * row_bytes(draft_width, kv_dtype))
    per_slot = state_bytes_per_slot(config, dtype, ssm_dtype) + draft_slot
    per_token = kv_bytes_per_token(config, kv_dtype, mtp_layers) + draft_token
    verify = args.speculative_num_draft_tokens + 1 if args.speculative_algorithm != "none" else 0
    token_state = state_bytes_per_slot(config, dtype, torch.float32)
    # what each running sequence needs beyond its slot: the verification's token states, the draft's roll-back states
    per_running = verify * token_state + (args.speculative_num_draft_tokens * draft_slot)
    if args.max_mamba_cache_size is not None:
        slots = args.max_mamba_cache_size
    elif per_slot == 0:
        slots = UNBOUNDED
    else:
        ratio = args.mamba_full_memory_ratio
        state_budget = int(rest * ratio / (1 + ratio))
        if args.max_running_requests is not None:
            slots = max(state_budget - args.max_running_requests * per_running, 0) // per_slot
        else:
            slots = state_budget // (per_slot + per_running)
    running = min(args.max_running_requests or slots, slots)
    kv_budget = rest - slots * per_slot - running * per_running
    rows_per_page = args.page_size // args.dcp_size
    pages = max(kv_budget, 0) // (per_token * rows_per_page) if per_token else UNBOUNDED
    if args.max_total_tokens is not None:
        pages = min(pages, args.max_total_tokens // args.page_size)
    if slots < 1 or pages < 1:
        raise MemoryPlanError(f"{rest / 2**30:.3f} GiB after the weights holds {slots} state slots of "
                              f"{per_slot:,} B and {pages} KV pages of {args.page_size} x {per_token:,} B; at least "
                              "one of each is needed: raise --mem-fraction-static or change the state:KV ratio.")
    held = pages * args.page_size
    if args.context_length is not None and args.context_length > held:
        raise MemoryPlanError(f"--context-length {args.context_length:,} needs {args.context_length:,} tokens of "
                              f"KV cache ({args.context_length * per_token / 2**30:.2f} GiB at {per_token:,} B per "
                              f"token) for one sequence, but the plan holds {held:,}: lower --context-length, or "
                              "raise --mem-fraction-static, or lower --mamba-full-memory-ratio (more of it for KV).")
    context = min(args.context_length or config.max_position_embeddings, held)
    return MemoryPlan(device_memory=memory, budget=budget, weight_bytes=weight_bytes, state_bytes_per_slot=per_slot,
                      kv_bytes_per_token=per_token, mtp_layers=mtp_layers, verify_tokens=verify,
                      token_state_bytes=token_state, num_slots=slots, num_pages=pages,
                      page_size=args.page_size, max_running_requests=running, context_length=context,
                      draft_state_bytes_per_slot=draft_slot, draft_kv_bytes_per_token=draft_token,
                      dcp_size=args.dcp_size, dflash_layers=draft_layers)
