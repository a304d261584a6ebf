"""The heaviest rank of a parallel layout, as the sharding rules see it: what layout.py hands model.py to size a
rank's share of the weights."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FirstRank:
    """Rank 0 of a layout as the engine's sharding rules see it (kestrel.distributed.sharding.Axes): attention and
    the vocabulary over the attention-TP group, dense MLPs over the TP group (the attention group with the
    all-to-all MoE, `a2a`), experts by EP and the rest of the TP group. `sglang`: SGLang's runtime, which replicates
    a few tensors kestrel splits (model.SGLANG_REPLICATED)."""

    attention_tp: int
    tp: int
    ep: int
    sglang: bool
    a2a: bool = False

    def axis(self, name: str) -> tuple[int, int]:
        return 0, {"attn_tp": self.attention_tp, "tp": self.tp, "ffn": self.attention_tp if self.a2a else self.tp,
                   "ep": self.ep, "moe_tp": self.tp // self.ep}[name]
