"""Reference greedy decoding over the model's forward API: one prefill, then one token per sequence per step.

This is the plain computation the engine's scheduler must reproduce (batching, chunking and preemption may not
change greedy tokens), kept deliberately simple: every sequence owns one state slot and enough pages up front.
"""

from __future__ import annotations

import torch

from ..layers.batch import ForwardBatch
from ..layers.cache import HybridCache
from .kimi import KimiForCausalLM


@torch.inference_mode()
def greedy_generate(model: KimiForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                    page_size: int = 16, stop_token_id: int | None = None) -> list[list[int]]:
    """Greedy continuations (up to max_new_tokens ids each, ending early at stop_token_id) of token-id prompts."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token.")
    device = model.lm_head.weight.device
    n = len(prompts)
    pages_per_seq = -(-(max(map(len, prompts)) + max_new_tokens) // page_size)
    cache = HybridCache.allocate(model.config, num_slots=n, num_pages=n * pages_per_seq, page_size=page_size,
                                 dtype=model.lm_head.weight.dtype, device=device)
    page_table = torch.arange(n * pages_per_seq, device=device).view(n, pages_per_seq)
    slots = list(range(n))

    lens = [len(p) for p in prompts]
    batch = ForwardBatch.build(lens, None, slots, page_table, page_size, device)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    last = batch.cu_seqlens[1:] - 1
    next_ids = model.compute_logits(model(ids, batch, cache)[last]).argmax(-1)

    outputs: list[list[int]] = [[] for _ in prompts]
    running = list(range(n))
    for _ in range(max_new_tokens):
        for i, token in zip(running, next_ids.tolist()):
            outputs[i].append(token)
        running = [i for i in running if outputs[i][-1] != stop_token_id and len(outputs[i]) < max_new_tokens]
        if not running:
            break
        batch = ForwardBatch.build([1] * len(running), [lens[i] + len(outputs[i]) - 1 for i in running],
                                   [slots[i] for i in running], page_table[running], page_size, device)
        ids = torch.tensor([outputs[i][-1] for i in running], device=device)
        next_ids = model.compute_logits(model(ids, batch, cache)).argmax(-1)
    return outputs
