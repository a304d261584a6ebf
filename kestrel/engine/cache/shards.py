"""A cache entry in one layout-free form, the single-process cache's: gathered from the ranks of a distributed
instance, and split again for another (a PD handoff between instances of any layouts).

Entries are named as device_ops saves parts ("{part}.kda.{i}.conv", "{part}.mla.{j}.latent", ...). A rank's entry
holds its pipeline stage's layers (numbered from the stage's first KDA and MLA layer; the last stage's MLA layers go
on with the MTP layers' and a draft's, numbered after the target's as in one process), its TP share of the KDA
heads (conv channels q | k | v of H / tp heads each, recurrent [H / tp, K, V]) and, with decode context
parallelism, the page rows of its positions (p % dcp == its dcp_rank, the same on every DCP group); without DCP
every TP rank holds the same MLA rows.
"""

from __future__ import annotations

import sys

import torch

from ...config import KDA, MLA, ModelConfig
from ...distributed.layout import ParallelLayout
from .hicache import Entry


def gather_entry(entries: list[Entry], layout: ParallelLayout, config: ModelConfig) -> Entry:
    """The single-process entry from every rank's entry (entries[r] from rank r)."""
    tp, dcp = layout.tp_size, layout.dcp_size
    full: Entry = {}
    for stage in range(layout.pp_size):
        ranks = range(stage * tp, (stage + 1) * tp)
        kda, mla = _first_layers(layout, config, stage)
        for name in entries[ranks[0]]:
            part, kind, index, field = name.split(".", 3)
            pieces = [entries[r][name] for r in ranks]
            if kind == "kda":
                name = f"{part}.kda.{kda + int(index)}.{field}"
                full[name] = (torch.cat([torch.cat([p.chunk(3, -1)[c] for p in pieces], -1) for c in range(3)], -1)
                              if field == "conv" else torch.cat(pieces))
            else:         # row j of the first DCP group's rank r holds the page's position j * dcp + r
                full[f"{part}.mla.{mla + int(index)}.{field}"] = torch.stack(pieces[:dcp], 1).flatten(0, 1) \
                    if dcp > 1 else pieces[0]
    return full


def shard_entry(entry: Entry, layout: ParallelLayout, config: ModelConfig) -> Entry:
    """This rank's share of a single-process entry."""
    if layout.world_size == 1:
        return entry
    tp, rank, dcp = layout.tp_size, layout.tp_rank, layout.dcp_size
    kda, mla = _first_layers(layout, config, layout.pp_rank)
    stage = layout.cache_config(config)
    mla_end = sys.maxsize if layout.last_stage else mla + len(stage.mla_layers)   # the last: MTP, draft layers too
    held = {"kda": range(kda, kda + len(stage.kda_layers)), "mla": range(mla, mla_end)}
    out: Entry = {}
    for name, t in entry.items():
        part, kind, index, field = name.split(".", 3)
        if int(index) not in held[kind]:
            continue
        local = f"{part}.{kind}.{int(index) - held[kind].start}.{field}"
        if kind == "kda":
            out[local] = (torch.cat([c.chunk(tp, -1)[rank] for c in t.chunk(3, -1)], -1) if field == "conv"
                          else t.chunk(tp)[rank]).contiguous()
        else:
            out[local] = t[layout.dcp_rank::dcp].contiguous() if dcp > 1 else t
    return out


def _first_layers(layout: ParallelLayout, config: ModelConfig, stage: int) -> tuple[int, int]:
    """How many KDA and MLA layers come before pipeline stage `stage`."""
    before = config.layer_types[:layout.stage_layers(config.num_hidden_layers, stage).start]
    return before.count(KDA), before.count(MLA)
