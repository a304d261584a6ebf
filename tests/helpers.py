"""Test helpers: tiny random models of each family member, and the plain greedy computation the engine must
reproduce."""

from __future__ import annotations

import torch

from kestrel.config import parse_config
from kestrel.layers.batch import ForwardBatch
from kestrel.layers.cache import HybridCache
from kestrel.models.checkpoint import build_model
from kestrel.models.init import init_weights
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.presets import tiny_config

FAMILY = ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"]


def tiny_model(preset: str, dtype: torch.dtype = torch.float32, seed: int = 0, std: float = 0.1, **overrides):
    """A random model of `preset`, its text-config keys replaced by `overrides` (eval mode)."""
    raw = tiny_config(preset)
    text = raw.get("text_config", raw)
    text.update(overrides)
    model = init_weights(build_model(parse_config(raw), dtype), seed=seed, std=std)
    for name, p in model.named_parameters():   # spread the router bias so it really steers selection
        if name.endswith("e_score_correction_bias"):
            p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return model.eval(), raw


def assert_idle(scheduler) -> None:
    """Nothing queued or running, and every page and state slot either free or held by the prefix cache alone,
    with the cache's own accounting consistent (no locks left, its pages and slots exactly those not free)."""
    assert not scheduler.running and not scheduler.waiting
    state, kv, cache = scheduler.state_pool, scheduler.kv_pool, scheduler.prefix_cache
    nodes, snapshots = (list(cache.nodes()), cache.snapshots) if cache is not None else ([], [])
    assert state.num_free + len(snapshots) == state.num_slots
    assert {s.slot for s in snapshots}.isdisjoint(state._free)
    held = {n.page for n in nodes} | {s.tail_page for s in snapshots if s.tail_page is not None}
    assert kv.num_used == 0 and len(held) == kv.num_pages - kv.num_free == kv.num_cached_only
    assert all(n.locks == 0 for n in nodes) and all(s.locks == 0 for s in snapshots)
    if cache is not None:
        assert cache.num_pages == len(nodes)


@torch.inference_mode()
def greedy_generate(model: KimiForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                    page_size: int = 16, stop_token_id: int | None = None) -> list[list[int]]:
    """Greedy continuations (up to max_new_tokens ids each, ending early at stop_token_id) of token-id prompts:
    one prefill, then one token per sequence per step, each sequence owning one slot and its pages up front."""
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
