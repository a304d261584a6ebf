"""Which rank does what: the rank layout of one model replica (pipeline stages of TP groups, and EP over each TP
group's ranks, SGLang's semantics).

A replica runs on `world_size = pp_size * tp_size` ranks. The decoder layers are cut into `pp_size` contiguous
stages (stage s holds layers [s * L // pp_size, (s + 1) * L // pp_size), the embedding on the first stage, the
final norm, LM head and MTP layers on the last). Within a stage, attention, dense MLPs, shared experts and the
vocabulary are split `tp_size` ways. Routed experts are split over the same ranks in two directions: `ep_size`
groups of whole experts (ep_size divides tp_size), and inside each group every expert's intermediate width is
split `moe_tp_size = tp_size / ep_size` ways:

    rank r: pp_rank = r // tp_size, tp_rank = r % tp_size, ep_rank = tp_rank // moe_tp_size,
            moe_tp_rank = tp_rank % moe_tp_size

Data-parallel attention (`dp_size` with SGLang's --enable-dp-attention, dividing tp_size) splits each TP group into
dp_size DP groups of attn_tp_size = tp_size / dp_size consecutive ranks: attention, its caches and the vocabulary
split over a DP group's ranks, and each group holds and attends only its own sequences; dense MLPs and experts
still split over the whole TP group, which computes them for every group's tokens:

    dp_rank = tp_rank // attn_tp_size, attn_tp_rank = tp_rank % attn_tp_size

Decode context parallelism (`dcp_size`, dividing attn_tp_size) splits the MLA cache by token: the attention group's
ranks form DCP groups of dcp_size consecutive ranks, and position p of every sequence is stored on the ranks whose
dcp_rank = attn_tp_rank % dcp_size is p % dcp_size (kestrel.layers.dcp).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ModelConfig

MXFP4_BLOCK = 32
"""Values per MXFP4 scale: a split of a packed expert's intermediate width falls on whole blocks."""


@dataclass(frozen=True)
class ParallelLayout:
    """The layout and this process's place in it."""

    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0
    pp_size: int = 1
    dcp_size: int = 1
    dp_size: int = 1           # DP attention groups per TP group (1: attention splits over the whole TP group)
    moe_a2a: bool = False      # routed experts' tokens dispatched all-to-all; the stream stays with its group
    redundant_experts: int = 0     # extra expert slots over the EP ranks (EPLB's replicas)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) must divide tp_size ({self.tp_size}): expert parallelism "
                             "runs over the tensor-parallel ranks.")
        if self.pp_size < 1:
            raise ValueError(f"pp_size must be at least 1, got {self.pp_size}.")
        if self.dp_size < 1 or self.tp_size % self.dp_size:
            raise ValueError(f"dp_size ({self.dp_size}) must divide tp_size ({self.tp_size}): DP attention splits "
                             "the TP group.")
        if self.dcp_size < 1 or self.attn_tp_size % self.dcp_size:
            raise ValueError(f"dcp_size ({self.dcp_size}) must divide the attention TP size ({self.attn_tp_size}): "
                             "decode context parallelism splits the attention group.")
        if self.redundant_experts < 0 or self.redundant_experts % self.ep_size:
            raise ValueError(f"the redundant experts ({self.redundant_experts}) must split evenly over ep_size "
                             f"{self.ep_size} (every EP rank holds as many expert slots).")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a layout of {self.world_size} ranks.")

    @classmethod
    def from_args(cls, args, rank: int = 0) -> ParallelLayout:
        """The layout EngineArgs ask for; a ValueError for the parallelism kestrel does not implement yet."""
        dp = args.dp_size if args.enable_dp_attention else 1
        if args.dp_size > 1 and not args.enable_dp_attention:
            raise ValueError("--dp-size without --enable-dp-attention runs whole replicas behind a router (`kestrel "
                             "serve` starts them); one engine runs one replica.")
        if dp > 1:
            refused = [(args.pp_size > 1, "--pp-size"), (args.dcp_size > 1, "--dcp-size"),
                       (args.speculative_algorithm != "none", "--speculative-algorithm")]
            for bad, flag in refused:
                if bad:
                    raise ValueError(f"DP attention does not run with {flag} yet; drop one of them.")
        if args.dcp_size > 1 and args.page_size % args.dcp_size:
            raise ValueError(f"--page-size {args.page_size} must be a multiple of --dcp-size {args.dcp_size} (each "
                             "rank holds page_size / dcp_size tokens of every page).")
        if args.moe_a2a_backend != "none":
            refused = [(args.ep_size == 1, "--ep-size 1 (nothing to dispatch)"),
                       (args.dcp_size > 1, "--dcp-size (as SGLang: no a2a backend under DCP)")]
            for bad, what in refused:
                if bad:
                    raise ValueError(f"--moe-a2a-backend {args.moe_a2a_backend} does not run with {what}.")
        layout = cls(args.tp_size, args.ep_size, rank, args.pp_size, args.dcp_size, dp,
                     args.moe_a2a_backend != "none", args.ep_num_redundant_experts)
        if layout.world_size % args.nnodes:
            raise ValueError(f"{layout.world_size} ranks cannot be spread evenly over {args.nnodes} nodes; make "
                             "--tp-size x --pp-size a multiple of --nnodes.")
        if args.nnodes > 1 and not args.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (where rank 0 listens).")
        return layout

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def attn_tp_size(self) -> int:
        """Ranks of one DP attention group (the whole TP group without DP attention)."""
        return self.tp_size // self.dp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.tp_rank % self.attn_tp_size

    @property
    def dp_rank(self) -> int:
        """This rank's DP attention group: whose sequences its caches hold."""
        return self.tp_rank // self.attn_tp_size

    @property
    def dcp_rank(self) -> int:
        """Which share of every page's positions this rank holds (p % dcp_size == dcp_rank)."""
        return self.attn_tp_rank % self.dcp_size

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.rank // self.tp_size

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, stage: int) -> int:
        """The rank of stage `stage` that has this rank's place in its TP group (where activations go and come
        from between stages)."""
        return stage * self.tp_size + self.tp_rank

    def stage_layers(self, num_layers: int, stage: int | None = None) -> range:
        """The decoder layers of pipeline stage `stage` (this rank's by default); the cookbook cuts the same way."""
        s = self.pp_rank if stage is None else stage
        return range(s * num_layers // self.pp_size, (s + 1) * num_layers // self.pp_size)

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    def axis(self, name: str) -> tuple[int, int]:
        """(this rank's index, parts) along a sharding axis: "attn_tp" (its DP attention group; the whole TP group
        without DP attention), "tp", "ffn" (dense MLPs and shared experts: "attn_tp" with the all-to-all MoE, "tp"
        otherwise), "ep" or "moe_tp"."""
        if name == "ffn":
            name = "attn_tp" if self.moe_a2a else "tp"
        return {"attn_tp": (self.attn_tp_rank, self.attn_tp_size), "tp": (self.tp_rank, self.tp_size),
                "ep": (self.ep_rank, self.ep_size), "moe_tp": (self.moe_tp_rank, self.moe_tp_size)}[name]

    def slots_per_rank(self, num_experts: int) -> int:
        """Routed-expert slots each EP rank holds: its share of the experts and of the redundant slots."""
        return (num_experts + self.redundant_experts) // self.ep_size

    def with_rank(self, rank: int) -> ParallelLayout:
        return dataclasses.replace(self, rank=rank)

    def attention(self) -> ParallelLayout:
        """The layout as this rank's attention sees it: a TP group of its DP group's ranks (itself without DP
        attention)."""
        if self.dp_size == 1:
            return self
        return ParallelLayout(self.attn_tp_size, 1, self.pp_rank * self.attn_tp_size + self.attn_tp_rank,
                              self.pp_size, self.dcp_size, moe_a2a=self.moe_a2a)

    def check_model(self, config: ModelConfig) -> None:
        """A ValueError naming every width of config that this layout cannot split."""
        tp, attn_tp, problems = self.tp_size, self.attn_tp_size, []
        heads = [("KDA heads", config.kda_num_heads if config.kda_layers else 0),
                 ("attention heads", config.num_attention_heads if config.mla_layers else 0),
                 ("indexer heads", config.index_n_heads if config.has_indexer else 0)]
        problems += [f"{n} {what}" + (f" (by the attention TP size {attn_tp})" if attn_tp < tp else "")
                     for what, n in heads if n % attn_tp]
        if config.num_experts and config.num_experts % self.ep_size:
            problems.append(f"{config.num_experts} routed experts (by ep_size {self.ep_size})")
        unit = MXFP4_BLOCK if config.experts_mxfp4 else 1
        if config.num_experts and config.moe_intermediate_size // unit < self.moe_tp_size:
            problems.append(f"the experts' intermediate width {config.moe_intermediate_size} into "
                            f"{self.moe_tp_size} parts" + (" of whole MXFP4 blocks" if unit > 1 else ""))
        ffn = self.axis("ffn")[1]
        for what, n, parts in [("dense MLP width", config.intermediate_size if config.first_k_dense_replace else tp,
                                ffn), ("vocabulary", config.vocab_size, tp)]:
            if n < parts:
                problems.append(f"{what} {n}")
        if problems:
            raise ValueError(f"tp_size {tp} cannot split this model's {', '.join(problems)}; choose sizes that "
                             "divide them.")
        if self.pp_size > config.num_hidden_layers:
            raise ValueError(f"pp_size {self.pp_size} exceeds the model's {config.num_hidden_layers} layers.")

    def cache_config(self, config: ModelConfig) -> ModelConfig:
        """The config whose caches one rank holds (for its DP group's sequences): its stage's layers (the MTP layers
        on the last stage only), its KDA heads' state (MLA latents are replicated over the attention group; DCP
        splits them by position, HybridCache.dcp_size)."""
        layers = self.stage_layers(config.num_hidden_layers)
        return dataclasses.replace(config, kda_num_heads=config.kda_num_heads // self.attn_tp_size,
                                   num_hidden_layers=len(layers),
                                   layer_types=config.layer_types[layers.start:layers.stop],
                                   num_nextn_predict_layers=config.num_nextn_predict_layers if self.last_stage else 0)


def partition(length: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """[lo, hi) of part `index` when `length` elements (whole units of `unit`) are split as evenly as possible."""
    if length % unit:
        raise ValueError(f"{length} elements do not split into units of {unit}.")
    base, extra = divmod(length // unit, parts)
    lo = index * base + min(index, extra)
    return lo * unit, (lo + base + (index < extra)) * unit
