"""`kestrel plan`: whether a model fits a hardware layout, how its memory splits, and how fast decode can go.

Combines the model's byte accounting (model.py), a parallel layout (layout.py), SGLang's pool arithmetic
(calculator.py, pools.py) and the decode roofline (roofline.py) for one device of the catalog (hardware.py).
Unknown hardware facts stay unknown: the plan lists each with the answers it blocks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from typing import Any

from .anchors import anchors, calculator_constants
from .calculator import (CacheSettings, balanced_ratio, kv_bytes_per_token_per_rank, slots_per_request,
                         verify_states, verify_width)
from ..disagg.size import handoff_bytes
from ..distributed.layout import ParallelLayout
from ..engine.args import EngineArgs
from ..engine.cache.planner import MemoryPlan, MemoryPlanError, plan_memory
from .context_cost import ContextCost, context_cost
from .hardware import CPU, CpuSpeed, Device, catalog, get_device, local_cpu
from .layout import Layout, NodeLayout, check_layout, node_layout
from .model import DTYPES, EXPERTS, KV_DTYPES, SSM_DTYPES, ModelFacts, model_facts
from .moe_traffic import PATHS, moe_bytes_per_token, moe_layers
from .pools import PoolInputs, Pools, size_pools
from .roofline import DecodeStep, crossover_context, decode_step

DEFAULT_BATCHES = (1, 8, 32, 64, 128, 256)
ENGINES = ("sglang", "kestrel")
"""Whose pool arithmetic a plan follows: SGLang's runtime, or kestrel's own engine (the CPU recipes)."""
HICACHE_CHOICES = ("off", "host", "host+storage")
MAX_DEVICES_SEARCHED = 4096


@dataclass(frozen=True)
class PlanRequest:
    """Everything `kestrel plan` takes; defaults mirror SGLang's server defaults and the B300 cells."""

    model: str = "k3"
    hardware: str = "b300"
    dtype: str = "bf16"                         # unquantized weights and activations (conv state)
    layout: Layout = field(default_factory=Layout)
    nodes: int | None = None
    cache: CacheSettings = field(default_factory=CacheSettings)
    hicache: str = "off"
    avg_request_len: int | None = None          # input + output tokens (None: the calculator's, within the context)
    mem_fraction: float = 0.85
    ratio: float | None = None                  # a pinned --mamba-full-memory-ratio instead of the balanced one
    max_running_requests: int | None = None     # whole server (SGLang divides it per attention-DP worker)
    max_mamba_cache_size: int | None = None     # whole server: pins the state slots instead of the ratio
    memory_bytes: int | None = None             # memory per device instead of the catalog's (e.g. a measurement)
    engine: str = "sglang"                      # whose pool arithmetic: ENGINES
    batches: tuple[int, ...] = DEFAULT_BATCHES
    context: int | None = None                  # roofline context length (default: avg_request_len)
    compare_devices: bool = True                # also find the minimum device count on every catalog device
    cpu_speed: CpuSpeed | None = None           # hardware "cpu": this machine's measured bandwidth and flop rate


@dataclass(frozen=True)
class Unknown:
    """A fact the catalog does not know, and the answers it blocks."""

    fact: str
    source: str
    blocks: tuple[str, ...]


@dataclass(frozen=True)
class Crossover:
    """For one batch size: where the KV or indexer reads overtake the weight reads."""

    batch: int
    kv_context: int | None                      # dense MLA latents (no indexer)
    indexer_context: int | None                 # lightning-indexer key scan
    indexer_to_weights_at_max_context: float | None


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    model: ModelFacts
    device: Device
    nodes: NodeLayout
    weight_bytes_per_rank: dict[str, int]       # by sharding class (+ draft), heaviest pipeline stage
    kv_bytes_per_token: int                     # whole model, one copy
    kv_bytes_per_token_per_rank: float          # / dcp + draft KV
    state_bytes_per_slot: int                   # whole model
    state_bytes_per_slot_per_rank: int          # / attention TP
    ring_bytes_per_slot_per_rank: int           # the ReplaySSM ring per slot (0 without ReplaySSM spec-verify)
    window_bytes_per_request_per_rank: int      # conv verify windows per running request (ReplaySSM spec-verify)
    slots_per_request: int                      # S
    verify_states: int                          # D
    balanced_ratio: float
    ratio: float                                # the one the pools use
    memory_bytes_per_rank: int | None
    pools: Pools | None                         # the tightest pipeline stage; None when the memory is unknown
    fits: bool | None
    fit_reason: str
    min_devices: dict[str, int | None]
    roofline: list[DecodeStep]
    crossovers: list[Crossover]
    context_cost: ContextCost                   # one token's context-dependent work at the roofline's context
    unknowns: list[Unknown]
    notes: list[str]
    handoff_bytes: int | None                   # a PD role's handoff of one avg_request_len prompt; None: Unified
    moe_bytes_per_token: dict[str, float]       # MoE wire bytes per token over all ranks, by path (moe_traffic.py)

    @property
    def weight_bytes_per_rank_total(self) -> int:
        return sum(self.weight_bytes_per_rank.values())

    @property
    def rank_speed(self) -> tuple[float, float] | None:
        """(bytes/s, flops/s) of one rank, or None when the device's bandwidth or flop rate is unknown."""
        bandwidth, rate = self.device.bandwidth_bytes_per_s, self.device.flop_rate
        if bandwidth is None or rate is None:
            return None
        return bandwidth / self.device.ranks_per_device, rate / self.device.ranks_per_device

    @property
    def admitted_requests(self) -> int | None:
        """Concurrency cap of the whole deployment (every attention-DP worker)."""
        return None if self.pools is None else self.pools.max_running_requests * self.request.layout.dp

    def as_dict(self) -> dict[str, Any]:
        request = asdict(self.request)
        request["batches"] = list(self.request.batches)
        return {
            "request": request,
            "model": {"name": self.model.name, "architecture": self.model.config.architecture,
                      "total_params": self.model.total_params, "active_params": self.model.active_params},
            "device": self.device.as_dict(),
            "nodes": asdict(self.nodes),
            "weight_bytes_per_rank": self.weight_bytes_per_rank,
            "weight_bytes_per_rank_total": self.weight_bytes_per_rank_total,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_per_rank": self.kv_bytes_per_token_per_rank,
            "state_bytes_per_slot": self.state_bytes_per_slot,
            "state_bytes_per_slot_per_rank": self.state_bytes_per_slot_per_rank,
            "ring_bytes_per_slot_per_rank": self.ring_bytes_per_slot_per_rank,
            "window_bytes_per_request_per_rank": self.window_bytes_per_request_per_rank,
            "slots_per_request": self.slots_per_request,
            "verify_states": self.verify_states,
            "balanced_ratio": self.balanced_ratio,
            "ratio": self.ratio,
            "memory_bytes_per_rank": self.memory_bytes_per_rank,
            "pools": None if self.pools is None else asdict(self.pools),
            "admitted_requests": self.admitted_requests,
            "fits": self.fits,
            "fit_reason": self.fit_reason,
            "min_devices": self.min_devices,
            "roofline": [step.as_dict() for step in self.roofline],
            "crossovers": [asdict(c) for c in self.crossovers],
            "context_cost": self.context_cost.as_dict(),
            "unknowns": [asdict(u) for u in self.unknowns],
            "notes": self.notes,
            "handoff_bytes": self.handoff_bytes,
            "moe_bytes_per_token": self.moe_bytes_per_token,
        }


def draft_model(model: str, spec: str) -> dict[str, Any] | None:
    """The anchors' draft model for `model` under `spec` (None when none is recorded)."""
    return (anchors()["models"].get(model, {}).get("spec") or {}).get(spec)


def draft_kv_bytes(draft: dict[str, Any]) -> int:
    """A draft model's KV per token: the recorded figure, else its cache from its config (an MLA draft caches
    kv_lora_rank + qk_rope_head_dim values per layer, as SGLang's MLA pool does)."""
    if "draft_kv_bytes_per_token" in draft:
        return draft["draft_kv_bytes_per_token"]
    config = draft["draft_config"]
    if config["attention"] != "mla":
        raise ValueError(f"no KV formula for a {config['attention']} draft is recorded.")
    return config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * config["dtype_bytes"]


def resolve_cache(request: PlanRequest) -> CacheSettings:
    """The request's cache settings with the draft's block size and KV per token defaulted from the anchors'
    draft model."""
    settings = request.cache
    if request.engine == "kestrel":       # its KV layout; a running request holds one state slot
        settings = replace(settings, kv_layout="kestrel", radix_strategy="off")
    if settings.spec != "none":
        draft = draft_model(request.model, settings.spec)
        if draft is None and (settings.draft_tokens == 0 or settings.draft_kv_bytes is None):
            raise ValueError(f"no draft model for {request.model} under --spec {settings.spec} is recorded; give "
                             "--draft-tokens N and --draft-kv-bytes N.")
        if settings.draft_tokens == 0:
            settings = replace(settings, draft_tokens=draft["draft_tokens"])
        if settings.draft_kv_bytes is None:
            settings = replace(settings, draft_kv_bytes=draft_kv_bytes(draft))
    settings.check()
    return settings


def _check_request(request: PlanRequest) -> None:
    if not 0 < request.mem_fraction <= 1:
        raise ValueError(f"--mem-fraction must be in (0, 1], got {request.mem_fraction}.")
    if request.avg_request_len is not None and request.avg_request_len < 1:
        raise ValueError(f"--avg-request-len must be at least 1 token, got {request.avg_request_len}.")
    if request.engine not in ENGINES:
        raise ValueError(f"unknown engine {request.engine!r}; choose one of: {', '.join(ENGINES)}.")
    if request.hicache not in HICACHE_CHOICES:
        raise ValueError(f"unknown --hicache {request.hicache!r}; choose one of: {', '.join(HICACHE_CHOICES)}.")
    if request.ratio is not None and request.ratio <= 0:
        raise ValueError(f"--ratio must be positive, got {request.ratio}.")
    for name, count in (("--max-running-requests", request.max_running_requests),
                        ("--max-mamba-cache-size", request.max_mamba_cache_size)):
        if count is not None and count < request.layout.dp:
            raise ValueError(f"{name} {count} leaves no request for some of the {request.layout.dp} attention-DP "
                             f"workers (SGLang gives each {name} // dp); raise it to at least {request.layout.dp}.")
    if any(b < 1 for b in request.batches):
        raise ValueError("every --batch size must be at least 1.")


def _sized_request(request: PlanRequest, model: ModelFacts) -> PlanRequest:
    """`request` with its average request length set when None: SGLang's calculator's default, or the model's context
    when that is shorter (no request is longer than the context); a ValueError for a given length beyond it."""
    context, length = model.config.max_position_embeddings, request.avg_request_len
    if length is None:
        return replace(request, avg_request_len=min(calculator_constants()["default_avg_request_len"], context))
    if length > context:
        raise ValueError(f"--avg-request-len {length:,} exceeds the model's context of {context:,} tokens (no request "
                         f"is longer); pass at most {context}.")
    return request


def _stage_weights(model: ModelFacts, layout: Layout, engine: str) -> list[dict[str, int]]:
    """Weight bytes per rank by sharding class, for each pipeline stage; with EPLB's redundant slots, the copies
    they hold (a rank holds (E + R) / ep expert slots instead of E / ep)."""
    stages = layout.stages(model.num_layers)
    weights = [dict(model.rank_bytes(layout.first_rank(engine), stage, s == 0, s == len(stages) - 1))
               for s, stage in enumerate(stages)]
    if layout.redundant_experts:
        for w in weights:
            w["redundant_experts"] = w[EXPERTS] * layout.redundant_experts // model.config.num_experts
    return weights


def _draft_bytes(request: PlanRequest, settings: CacheSettings) -> int | None:
    """Draft weights per rank (replicated on every rank, the conservative assumption); None when unknown."""
    if settings.spec == "none":
        return 0
    draft = draft_model(request.model, settings.spec)
    return None if draft is None else draft["draft_weight_bytes"]


def _max_running(request: PlanRequest, settings: CacheSettings) -> int | None:
    """--max-running-requests as SGLang resolves it: unset under speculation means 48."""
    if request.max_running_requests is None and settings.spec != "none":
        return calculator_constants()["spec_default_max_running_requests"]
    return request.max_running_requests


def _ring_bytes(model: ModelFacts, settings: CacheSettings, layers: range | None = None) -> int:
    """The ReplaySSM ring of one slot over `layers`; SGLang allocates it under ReplaySSM spec-verify only."""
    if settings.spec == "none" or not settings.replay_ssm:
        return 0
    return model.replay_ring_bytes_per_slot(settings.replay_cache_len, layers)


def _pools(request: PlanRequest, model: ModelFacts, settings: CacheSettings, stage_weights: list[dict[str, int]],
           memory_per_rank: int, ratio: float, slots: int, verify: int) -> Pools:
    """The tightest stage's pools (fewest admitted requests, then fewest tokens). Every stage charges the largest
    stage's state per slot, as SGLang does (kv_cache_configurator._handle_max_mamba_cache)."""
    layout = request.layout
    if request.engine == "kestrel":
        return _kestrel_pools(request, model, [sum(w.values()) for w in stage_weights], memory_per_rank, ratio)
    stages = layout.stages(model.num_layers)
    budget = int(memory_per_rank * request.mem_fraction)
    # A model without KDA layers needs no state memory: one byte per slot stands for "free".
    widest = max(model.state_bytes_per_slot(settings.ssm_dtype, stage) for stage in stages)
    state = max(1, widest // layout.attention_tp)
    ring = max(_ring_bytes(model, settings, stage) for stage in stages) // layout.attention_tp
    window = max(_window_bytes(model, settings, stage) for stage in stages) // layout.attention_tp
    results = []
    for s, stage in enumerate(stages):
        kv = kv_bytes_per_token_per_rank(model.kv_bytes_per_token(settings.kv_dtype, stage, settings.row_scales),
                                         layout.dcp, settings)
        inputs = PoolInputs(rest_bytes=budget - sum(stage_weights[s].values()), ratio=ratio, state_bytes=state,
                            kv_bytes_per_token=kv, slots_per_request=slots, verify_states=verify, ring_bytes=ring,
                            window_bytes=window,
                            context_len=model.config.max_position_embeddings, dp=layout.dp,
                            max_running_requests=_max_running(request, settings),
                            max_mamba_cache_size=request.max_mamba_cache_size,
                            radix_disabled=settings.radix_strategy == "off")
        results.append(size_pools(inputs))
    return min(results, key=lambda p: (p.max_running_requests, p.kv_tokens))


def kestrel_args(request: PlanRequest, ratio: float) -> EngineArgs:
    """The engine arguments of kestrel's ranks under `request` (the command its recipe prints)."""
    layout = request.layout
    return EngineArgs(model=request.model, device="cpu" if request.hardware == CPU else "cuda",
                      mem_fraction_static=request.mem_fraction, mamba_full_memory_ratio=ratio,
                      max_mamba_cache_size=request.max_mamba_cache_size,
                      max_running_requests=request.max_running_requests, tp_size=layout.tp, ep_size=layout.ep,
                      dp_size=layout.dp, enable_dp_attention=layout.dp > 1, dcp_size=layout.dcp, pp_size=layout.pp,
                      moe_a2a_backend="torch" if layout.a2a else "none", enable_eplb=layout.redundant_experts > 0,
                      ep_num_redundant_experts=layout.redundant_experts)


def check_kestrel_layout(request: PlanRequest, model: ModelFacts) -> ParallelLayout:
    """The engine's own layout checks (a ValueError for parallelism it does not run or a model it cannot split)."""
    layout = ParallelLayout.from_args(kestrel_args(request, 1.0))
    layout.check_model(model.config)
    return layout


def _kestrel_pools(request: PlanRequest, model: ModelFacts, stage_weight_bytes: list[int], memory_per_rank: int,
                   ratio: float) -> Pools:
    """The pools kestrel's engine allocates on each rank: its own planner (kestrel.engine.cache.planner) on the
    first rank of each pipeline stage (the heaviest of its stage) with that stage's layers, then, as the ranks
    agree (engine.ranks.load_shard), the fewest slots and pages of any stage; S = 1 (a running request holds one
    state slot)."""
    settings = request.cache
    layout = check_kestrel_layout(request, model)
    args = kestrel_args(request, ratio).dp_group_args()

    def stage_plan(stage: int, engine_args: EngineArgs) -> MemoryPlan:
        config = layout.with_rank(layout.stage_rank(stage)).cache_config(model.config)
        return plan_memory(config, engine_args, stage_weight_bytes[stage], memory_per_rank, DTYPES[model.dtype],
                           SSM_DTYPES[settings.ssm_dtype], KV_DTYPES[settings.kv_dtype])

    heaviest = max(stage_weight_bytes)
    try:
        plans = [stage_plan(s, args) for s in range(layout.pp_size)]
        if len(plans) > 1:
            agreed = replace(args, max_mamba_cache_size=min(p.num_slots for p in plans),
                             max_total_tokens=min(p.num_pages for p in plans) * args.page_size)
            plans = [stage_plan(s, agreed) for s in range(layout.pp_size)]
    except MemoryPlanError:
        return Pools(int(memory_per_rank * request.mem_fraction) - heaviest, 0, 0, 0)
    memory_plan = plans[0]
    return Pools(memory_plan.budget - heaviest, memory_plan.num_slots, memory_plan.kv_tokens,
                 memory_plan.max_running_requests)


def _handoff_bytes(request: PlanRequest, model: ModelFacts, settings: CacheSettings) -> int | None:
    """What kestrel's prefill instance sends its decode instance for one prompt of avg_request_len tokens (its own
    page size and KV layout); None in Unified mode."""
    if settings.mode == "unified":
        return None
    return handoff_bytes(model.config, request.avg_request_len, EngineArgs.page_size, DTYPES[model.dtype],
                         SSM_DTYPES[settings.ssm_dtype], KV_DTYPES[settings.kv_dtype])


def min_devices(model: ModelFacts, device: Device, settings: CacheSettings, mem_fraction: float, avg_request_len: int,
                draft_bytes: int, engine: str = "sglang") -> int | None:
    """The fewest devices that hold the weights (tensor parallelism, DP attention beyond the head count) and one
    request of avg_request_len; None when the device's memory is unknown or no count up to the search limit does."""
    memory = device.memory_bytes
    if memory is None:
        return None
    heads = math.gcd(*model.attention_heads)
    budget = memory // device.ranks_per_device * mem_fraction
    slots, verify = slots_per_request(settings), verify_states(settings)
    kv = kv_bytes_per_token_per_rank(model.kv_bytes_per_token(settings.kv_dtype, row_scales=settings.row_scales), 1,
                                     settings)
    for ranks in range(1, MAX_DEVICES_SEARCHED + 1):
        attention_tp = math.gcd(ranks, heads)
        weights = model.rank_bytes(Layout(tp=ranks, dp=ranks // attention_tp).first_rank(engine))
        rest = budget - sum(weights.values()) - draft_bytes
        if rest <= 0:
            continue
        state = model.state_bytes_per_slot(settings.ssm_dtype) // attention_tp
        ratio = balanced_ratio(slots, verify, state, kv, avg_request_len)
        pools = size_pools(PoolInputs(rest_bytes=int(rest), ratio=ratio, state_bytes=state, kv_bytes_per_token=kv,
                                      slots_per_request=slots, verify_states=verify,
                                      ring_bytes=_ring_bytes(model, settings) // attention_tp,
                                      window_bytes=_window_bytes(model, settings) // attention_tp,
                                      context_len=model.config.max_position_embeddings))
        if pools.holds(avg_request_len):
            return math.ceil(ranks / device.ranks_per_device)
    return None


def _unknowns(device: Device, request: PlanRequest, draft_bytes: int | None) -> list[Unknown]:
    unknowns = []
    if (request.memory_bytes or device.memory_bytes) is None:
        unknowns.append(Unknown(f"{device.id} memory", device.fact("memory").source,
                                ("fits", "pool sizes", "KV token capacity", "concurrency cap", "minimum device count")))
    if device.bandwidth_bytes_per_s is None:
        unknowns.append(Unknown(f"{device.id} memory bandwidth", device.fact("memory_bandwidth").source,
                                ("decode roofline tokens/s per user and per device", "per-token times at a context")))
    elif device.flop_rate is None:
        unknowns.append(Unknown(f"{device.id} dense multiply rate", device.fact("bf16_dense").source,
                                ("per-token times at a context",)))
    if device.devices_per_node is None and request.nodes is None:
        unknowns.append(Unknown(f"{device.id} devices per node", device.fact("devices_per_node").source,
                                ("node count",)))
    if draft_bytes is None:
        draft = draft_model(request.model, request.cache.spec)
        source = draft["draft_weight_source"] if draft else f"no draft model recorded for {request.model}"
        unknowns.append(Unknown(f"{request.cache.spec} draft model weights", source,
                                ("weights per rank include no draft model", "fits")))
    return unknowns


def _window_bytes(model: ModelFacts, settings: CacheSettings, layers: range | None = None) -> int:
    """The conv verify windows of one running request over `layers` that SGLang keeps under ReplaySSM spec-verify
    (its verify states are gone, the conv rollback windows are not); 0 otherwise (without ReplaySSM they are part
    of the D verify states)."""
    if settings.spec == "none" or not settings.replay_ssm or settings.mode == "prefill":
        return 0
    return model.conv_window_bytes_per_request(verify_width(settings), layers)


def _kv_note(settings: CacheSettings, model: ModelFacts) -> str | None:
    if settings.kv_layout == "kestrel":
        return ("KV counted in kestrel's layout (fp8 with a 4-byte scale per token and row)"
                if settings.kv_dtype == "fp8" else None)
    if model.config.has_indexer:
        return ("KV counted in SGLang main's DSA pool (DSATokenToKVPool: calculate_mla_kv_cache_dim's row, 656 B per "
                "layer in fp8, and fp8 indexer keys with a scale per 128); which pool SGLang's kimi-k31-pro branch "
                "gives K3.1 Pro is not known, and the trtllm DSA backend and ROCm's raw layout keep 576 bytes instead")
    return "fp8 KV counted in SGLang's layout (per-tensor scales, as its calculator counts it)" \
        if settings.kv_dtype == "fp8" else None


def _spec_notes(request: PlanRequest, settings: CacheSettings) -> list[str]:
    if settings.spec == "none":
        return []
    draft = draft_model(request.model, settings.spec)
    notes = [f"speculation ({settings.spec}, block {settings.draft_tokens}, verify width {verify_width(settings)}): "
             "draft weights counted on every rank; SGLang resets an unset --max-running-requests to 48; the roofline "
             "assumes every drafted token is accepted",
             f"the draft's KV: {settings.draft_kv_bytes:,} B per token per rank ("
             + (draft["draft_kv_source"] if draft and settings.draft_kv_bytes == draft_kv_bytes(draft)
                else "given") + ")"]
    if settings.replay_ssm:
        notes.append(f"ReplaySSM spec-verify: no verify states (D = 0), but a ring of {settings.replay_cache_len} "
                     "steps per state slot (--linear-replayssm-cache-len: the ring length of a KDA model) and the conv "
                     f"verify windows of every running request ({verify_width(settings)} tokens deep, kept for the "
                     "conv rollback), both charged to the state pool as SGLang's newer solver charges them "
                     "(test_replayssm_spec_drops_snapshots_and_charges_the_ring; 0.5.23 leaves the windows out); the "
                     "pinned ratio (the page's calculator) "
                     "leaves both out")
    return notes


def _notes(request: PlanRequest, settings: CacheSettings, model: ModelFacts) -> list[str]:
    kestrel = request.engine == "kestrel"
    notes = ["pools: kestrel's own planner (kestrel/engine/cache/planner.py) on the heaviest rank's shard, as its "
             "ranks size them (they agree on the smallest); activations are not counted" if kestrel else
             "pools are upper bounds: SGLang also subtracts CUDA graphs, activations and communication buffers, "
             "which the planner does not model",
             "memory per device: " + ("given" if request.memory_bytes else "the vendor datasheet's figure (one basis "
                                      "for every device; measured figures are alternatives in the catalog)"),
             "weights per rank by kestrel's sharding rules (kestrel/distributed/sharding.py), rank 0's share: routed "
             "experts in the checkpoint's format (MXFP4 for K3) split by EP and the rest of the TP group, dense MLPs "
             "and shared experts over TP, attention heads and the vocabulary over attention TP, the rest replicated"
             + ("" if kestrel else "; as SGLang runs them, the indexer's projections replicated and expert widths "
                                   "split on any row")]
    notes += [n for n in [_kv_note(settings, model)] if n]
    notes += _spec_notes(request, settings)
    if request.layout.dp > 1:
        notes.append(f"DP attention: SGLang gives each of the {request.layout.dp} workers --max-running-requests // dp "
                     "and --max-mamba-cache-size // dp; pools are per worker, admitted requests for all of them")
    if request.max_mamba_cache_size is not None:
        notes.append(f"--max-mamba-cache-size {request.max_mamba_cache_size} pins the state slots; the ratio is not "
                     "used")
    if request.hicache != "off":
        notes.append(f"HiCache ({request.hicache}) adds a host-memory tier for the prefix settings; the GPU pools are "
                     "unchanged and the host tier's size is not modelled")
    if request.layout.pp > 1:
        notes.append("pipeline parallelism turns SGLang's overlap scheduler off (S counts a 1-slot track buffer)")
    notes += _moe_notes(request.layout)
    return notes


def _moe_notes(layout: Layout) -> list[str]:
    notes = []
    if layout.a2a:
        notes.append("all-to-all MoE: dense MLPs and shared experts split over the attention group (tp / dp ranks) in "
                     "the weights per rank; comm/step is kestrel.distributed.traffic.a2a_traffic with the pairs "
                     "expected under uniform routing (a skewed router sends more to its hot experts' ranks until EPLB "
                     "re-places them)" + ("" if layout.dcp == 1 else "; not counted with DCP"))
    if layout.redundant_experts:
        notes.append(f"EPLB: {layout.redundant_experts} redundant expert slots, "
                     f"{layout.redundant_experts // layout.ep} more per EP rank, counted in the weights per rank "
                     "(redundant_experts)")
    return notes


def _moe_traffic(model: ModelFacts, layout: Layout) -> dict[str, float]:
    """MoE wire bytes per token over all ranks of the layout's TP group, on each path the layout can take (the
    all-to-all path needs EP); empty without MoE layers or tensor parallelism."""
    config = model.config
    if layout.tp == 1 or not moe_layers(config):
        return {}
    paths = PATHS if layout.ep > 1 else PATHS[:1]
    return {path: moe_bytes_per_token(config, layout.tp, layout.ep, layout.dp, path, DTYPES[model.dtype].itemsize,
                                      redundant=layout.redundant_experts) for path in paths}


def _crossovers(model: ModelFacts, steps: list[DecodeStep]) -> list[Crossover]:
    max_context = model.config.max_position_embeddings
    result = []
    for step in steps:
        at_max = (step.index_key_bytes / step.context * max_context / step.weight_bytes
                  if step.index_key_bytes else None)
        result.append(Crossover(step.batch, crossover_context(step, "kv"), crossover_context(step, "index_keys"),
                                at_max))
    return result


@cache
def plan(request: PlanRequest) -> Plan:
    """Plan `request` (see the module docstring); raises ValueError for bad input or an impossible layout.
    Plans are cached per request: treat them as read-only."""
    _check_request(request)
    layout = request.layout
    device = local_cpu(layout.world, request.cpu_speed) if request.hardware == CPU else get_device(request.hardware)
    model = model_facts(request.model, request.dtype)
    request = _sized_request(request, model)
    check_layout(layout, model)
    if request.engine == "kestrel":
        check_kestrel_layout(request, model)
    settings = resolve_cache(request)
    nodes = node_layout(layout, device, request.nodes)

    stage_weights = _stage_weights(model, layout, request.engine)
    draft_bytes = _draft_bytes(request, settings)
    for weights in stage_weights:
        weights["draft"] = draft_bytes or 0
    heaviest = max(stage_weights, key=lambda w: sum(w.values()))

    slots = slots_per_request(settings, layout.pp)
    verify = verify_states(settings)
    state_rank = model.state_bytes_per_slot(settings.ssm_dtype) // layout.attention_tp
    kv_bytes = model.kv_bytes_per_token(settings.kv_dtype, row_scales=settings.row_scales)
    kv_rank = kv_bytes_per_token_per_rank(kv_bytes, layout.dcp, settings)
    balanced = balanced_ratio(slots, verify, state_rank, kv_rank, request.avg_request_len)
    ratio = request.ratio or balanced

    memory = request.memory_bytes or device.memory_bytes
    memory_per_rank = None if memory is None else memory // device.ranks_per_device
    pools = None if memory_per_rank is None else _pools(request, model, settings, stage_weights, memory_per_rank,
                                                        ratio, slots, verify)
    fits, reason = _fit(pools, request)

    bandwidth = device.bandwidth_bytes_per_s
    bandwidth_per_rank = None if bandwidth is None else bandwidth / device.ranks_per_device
    tokens_per_sequence = verify_width(settings)
    context = request.context or request.avg_request_len
    interconnect = device.fact("scale_up_bandwidth")
    interconnect_per_rank = (interconnect.value * 1e9 / device.ranks_per_device
                             if interconnect.value and interconnect.unit == "GB/s" else None)
    steps = [decode_step(model, layout, settings, bandwidth_per_rank, nodes.devices, b, context, tokens_per_sequence,
                         engine=request.engine, interconnect_per_rank=interconnect_per_rank)
             for b in request.batches]
    others = {d.id: min_devices(model, d, settings, request.mem_fraction, request.avg_request_len, draft_bytes or 0,
                                request.engine)
              for d in catalog().values()} if request.compare_devices else {}
    return Plan(request=request, model=model, device=device, nodes=nodes, weight_bytes_per_rank=heaviest,
                kv_bytes_per_token=kv_bytes, kv_bytes_per_token_per_rank=kv_rank,
                state_bytes_per_slot=model.state_bytes_per_slot(settings.ssm_dtype),
                state_bytes_per_slot_per_rank=state_rank,
                ring_bytes_per_slot_per_rank=_ring_bytes(model, settings) // layout.attention_tp,
                window_bytes_per_request_per_rank=_window_bytes(model, settings) // layout.attention_tp,
                slots_per_request=slots, verify_states=verify,
                balanced_ratio=balanced, ratio=ratio, memory_bytes_per_rank=memory_per_rank, pools=pools, fits=fits,
                fit_reason=reason, min_devices=others, roofline=steps, crossovers=_crossovers(model, steps),
                context_cost=context_cost(model, context, settings, layout),
                unknowns=_unknowns(device, request, draft_bytes), notes=_notes(request, settings, model),
                handoff_bytes=_handoff_bytes(request, model, settings),
                moe_bytes_per_token=_moe_traffic(model, layout))


def _fit(pools: Pools | None, request: PlanRequest) -> tuple[bool | None, str]:
    if pools is None:
        return None, f"unknown: the memory of {request.hardware} is not in the catalog"
    if pools.rest_bytes <= 0:
        return False, (f"the weights need more than --mem-fraction {request.mem_fraction} of each rank's memory "
                       f"({-pools.rest_bytes / 1e9:.1f} GB short)")
    if not pools.holds(request.avg_request_len):
        return False, (f"after the weights the pools hold {pools.kv_tokens:,} KV tokens and "
                       f"{pools.max_running_requests} requests, not one request of {request.avg_request_len:,} "
                       "tokens")
    return True, (f"{pools.max_running_requests:,} requests of {request.avg_request_len:,} tokens per attention-DP "
                  "worker")
