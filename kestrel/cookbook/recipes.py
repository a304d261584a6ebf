"""`kestrel recipe`: launch commands for kestrel, SGLang and vLLM for one choice of model, hardware, mode,
strategy, speculation, HiCache and quantization, with the planner's memory ratio pinned.

A recipe is named by an id, `model/hardware/mode/strategy[,spec=...][,hicache=...][,quant=...]`, which evidence
records and the verification matrix use. SGLang's page is the anchor: a combination it does not offer is refused
with its reason; vLLM and kestrel may refuse a recipe SGLang offers, each with its own reason. A PD recipe (mode
prefill or decode) is one half of a disaggregated deployment: that role's instance, then the router in front of both.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..engine.args import BUNDLED_MODEL
from . import sglang_recipe, vllm_recipe
from .anchors import anchors
from .calculator import MODES, CacheSettings, ratio_text
from .flags import flag_value, has_flag, parse_flags
from .hardware import CPU
from .layout import Layout
from .planner import Plan, PlanRequest, plan
from .recipe_request import STRATEGIES, RecipeRefused, RecipeRequest

ENGINES = ("kestrel", "sglang", "vllm")
SGLANG_A2A_BACKENDS = frozenset({"deepep", "deepep_v2", "megamoe", "mooncake", "nixl", "ascend_fuseep", "flashinfer",
                                 "flashinfer_megamoe", "mori", "pplx"})
"""SGLang's all-to-all MoE backends (--moe-a2a-backend) that spread the experts over the whole TP group: with any of
them SGLang sets --ep-size to --tp-size (SGLang 0.5.23, srt/arg_groups/overrides.py: _A2A_EP_SPANNING_BACKENDS and
_a2a_ep_size). kestrel's command for such a cell dispatches with its own backend, --moe-a2a-backend torch."""


@dataclass(frozen=True)
class EngineCommand:
    """What to run for one engine."""

    lines: list[str]              # commands, in order
    image: str | None = None      # container image
    strategy: str | None = None   # the engine's own name for the lane
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Recipe:
    request: RecipeRequest
    plan: Plan
    ratio_text: str               # as pinned into --mamba-full-memory-ratio
    lane: str                     # SGLang's name for the lane
    nodes: int
    per_node: int
    sglang_status: str | None     # the badge SGLang's own page shows
    commands: dict[str, EngineCommand]
    refusals: dict[str, str]      # engine -> why it has no command
    notes: list[str]

    @property
    def id(self) -> str:
        return self.request.id

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "request": asdict(self.request), "layout": self.plan.request.layout.describe(),
                "nodes": self.nodes, "per_node": self.per_node, "lane": self.lane, "ratio": self.ratio_text,
                "sglang_status": self.sglang_status, "commands": {k: asdict(v) for k, v in self.commands.items()},
                "refusals": self.refusals, "notes": self.notes, "plan": self.plan.as_dict()}


def _cpu_model(model: str) -> tuple[str, str, list[str]]:
    """(plan model, folder to serve, commands that prepare it): the bundled model is served as shipped (its own
    config, trained weights; `kestrel verify` checks its held-out perplexity), the other tiny models as a random
    checkpoint of their preset."""
    if model == BUNDLED_MODEL.name:
        return str(BUNDLED_MODEL), f"models/{model}", []
    folder = f"models/{model}-random"
    return model, folder, [f"kestrel random-model {model} --out {folder}"]


def _kestrel_rules() -> dict[str, Any]:
    return anchors()["kestrel"]


def _hicache_flags(hicache: str) -> list[str]:
    return [] if hicache == "off" else [_kestrel_rules()["hicache_flags"][hicache]]


def _kestrel_serve(folder: str, device: str, kestrel_plan: Plan, ratio: str, extra: list[str],
                   moe: list[str] | None = None) -> str:
    """The `kestrel serve` line that runs kestrel_plan (its layout, memory fraction, ratio and cache dtypes), with
    the MoE path's flags `moe` after the expert parallelism."""
    request, cache = kestrel_plan.request, kestrel_plan.request.cache
    layout = request.layout
    parts = ["kestrel serve", f"--model {folder}", f"--device {device}"]
    if device == "cpu":
        parts.append("--dtype float32")
    if layout.tp > 1:
        parts.append(f"--tp-size {layout.tp}")
    if layout.dp > 1:
        parts.append(f"--dp-size {layout.dp} --enable-dp-attention")
    if layout.ep > 1:
        parts.append(f"--ep-size {layout.ep}")
    parts += moe or []
    if layout.pp > 1:
        parts.append(f"--pp-size {layout.pp}")
    if layout.dcp > 1:
        parts.append(f"--dcp-size {layout.dcp}")
    parts += [f"--mem-fraction-static {request.mem_fraction}", f"--mamba-full-memory-ratio {ratio}",
              f"--mamba-ssm-dtype {'float32' if cache.ssm_dtype == 'fp32' else 'bfloat16'}",
              f"--kv-cache-dtype {'fp8_e4m3' if cache.kv_dtype == 'fp8' else 'auto'}"]
    if request.max_running_requests is not None:
        parts.append(f"--max-running-requests {request.max_running_requests}")
    return " ".join([*parts, *extra])


def _handoff_note(recipe_plan: Plan) -> list[str]:
    """The plan's PD handoff size, for a prefill or decode recipe."""
    if recipe_plan.handoff_bytes is None:
        return []
    return [f"a PD handoff of a prompt of {recipe_plan.request.avg_request_len:,} tokens moves "
            f"{recipe_plan.handoff_bytes / 1e9:,.3f} GB in kestrel's layout (latents and indexer keys in whole pages, "
            "plus the fixed KDA state: kestrel.disagg.size.handoff_bytes)"]


def _kestrel_cpu(request: RecipeRequest) -> Recipe:
    """kestrel on this machine's CPU, one device per instance: the bundled model, or a random checkpoint of a tiny
    preset; Unified, or one PD role on loopback."""
    rules = _kestrel_rules()
    if request.model not in rules["cpu_models"]:
        raise RecipeRefused(f"CPU recipes serve the tiny models ({', '.join(rules['cpu_models'])}); "
                            f"{request.model} does not fit a CPU machine (see `kestrel plan`).")
    if request.strategy != "low-latency":
        raise RecipeRefused("a CPU recipe is one device per instance: the low-latency strategy (Unified, or one PD "
                            "role).")
    if request.spec != "none":
        raise RecipeRefused(rules["unsupported"]["spec"] + ".")
    if request.quant is not None:
        raise RecipeRefused("the tiny models keep their formats; drop --quant.")
    plan_model, folder, prepare = _cpu_model(request.model)
    cpu_plan = plan(PlanRequest(model=plan_model, hardware=CPU, dtype="fp32", layout=Layout(tp=1),
                                cache=CacheSettings(kv_dtype="fp32", mode=request.mode), hicache=request.hicache,
                                avg_request_len=request.avg_request_len, mem_fraction=rules["cpu_mem_fraction"],
                                batches=(1, 8), engine="kestrel"))
    ratio = ratio_text(cpu_plan.ratio)
    extra, router, pd_notes = _hicache_flags(request.hicache), [], []
    if request.mode != "unified":
        pd = rules["pd"]
        extra += [pd["role_flags"][request.mode], f"--port {pd['ports'][request.mode]}"]
        router = [pd["router"]]
        halves = {mode: replace(request, mode=mode).id for mode in ("prefill", "decode")}
        pd_notes = [pd["note"].format(**halves), *_handoff_note(cpu_plan)]
    lines = [*prepare, _kestrel_serve(folder, "cpu", cpu_plan, ratio, extra), *router]
    model_note = ("random weights: a smoke test of the serving path, not a model" if prepare else
                  "the bundled model, trained" + ("; `kestrel verify` checks it by its held-out perplexity"
                                                  if request.mode == "unified" else ""))
    notes = [rules["radix_note"], model_note, *pd_notes]
    refusal = "SGLang and vLLM publish no CPU recipe for this family"
    lane = "kestrel on CPU" + ("" if request.mode == "unified" else f", {request.mode} instance")
    return Recipe(request=request, plan=cpu_plan, ratio_text=ratio, lane=lane, nodes=1, per_node=1,
                  sglang_status=None, commands={"kestrel": EngineCommand(lines=lines, strategy="single device")},
                  refusals={"sglang": refusal, "vllm": refusal}, notes=notes)


def _sglang_command(cell: sglang_recipe.SGLangCell, request: RecipeRequest, ratio: str) -> EngineCommand:
    lines = sglang_recipe.commands(cell, request.mode, ratio)
    if request.mode != "unified":
        lines.append(sglang_recipe.router_command(request.model))
    return EngineCommand(lines=lines, image=cell.image, strategy=cell.label, notes=cell.notes)


def _recipe_notes(cell: sglang_recipe.SGLangCell, request: RecipeRequest, recipe_plan: Plan) -> list[str]:
    notes = []
    if cell.pins_mamba_cache_size:
        notes.append("this cell sizes the state pool with --max-mamba-cache-size instead of a ratio; the ratio shown "
                     "is the balanced one, for comparison")
    if request.mode != "unified":
        notes.append("PD disaggregation: run the prefill and decode servers, then the router; SGLang's router takes "
                     "the prefill's bootstrap port after its URL")
    return notes + _handoff_note(recipe_plan)


def wide_ep_cells() -> list[tuple[str, bool]]:
    """The anchor cells whose SGLang flags dispatch the experts all-to-all (SGLANG_A2A_BACKENDS) or enable EPLB, as
    (model/hardware/mode/strategy, whether kestrel runs on that hardware: NVIDIA GPUs)."""
    cells = []
    for cell in anchors()["cells"]:
        flags = parse_flags(cell["flags"])
        if flag_value(flags, "--moe-a2a-backend") in SGLANG_A2A_BACKENDS or has_flag(flags, "--enable-eplb"):
            lane = "/".join([cell.get("model", "k3"), cell["hw"], cell["mode"], cell["strategy"]])
            cells.append((lane, anchors()["hardware"][cell["hw"]]["family"] == "nvidia"))
    return cells


def kestrel_moe(cell: sglang_recipe.SGLangCell, layout: Layout) -> tuple[Layout, list[str], list[str]]:
    """kestrel's layout, `kestrel serve` MoE flags and notes for an SGLang cell on `layout`: a cell that dispatches
    its experts all-to-all (SGLANG_A2A_BACKENDS) gets kestrel's all-to-all (--moe-a2a-backend torch) at EP = TP, as
    SGLang sets EP for those backends; a cell with --enable-eplb gets kestrel's EPLB with the cell's
    --ep-num-redundant-experts, or one redundant slot per EP rank when it names none, rounded up to a multiple of
    the EP size (kestrel gives every EP rank as many slots), and its --eplb-rebalance-num-iterations."""
    backend = flag_value(cell.flags, "--moe-a2a-backend")
    a2a, eplb = backend in SGLANG_A2A_BACKENDS, has_flag(cell.flags, "--enable-eplb")
    flags, notes = [], []
    ep = layout.tp if a2a else layout.ep
    if a2a:
        flags.append("--moe-a2a-backend torch")
        notes.append(f"SGLang's cell dispatches the routed experts' tokens all-to-all (--moe-a2a-backend {backend}, "
                     f"EP{ep} = TP as SGLang sets it); kestrel's all-to-all runs over torch.distributed "
                     "(--moe-a2a-backend torch)" + (", each token's residual stream staying with its DP attention "
                                                     "group" if layout.dp > 1 else ""))
    redundant = 0
    if eplb:
        named = flag_value(cell.flags, "--ep-num-redundant-experts")
        # Default when the cell names none (SGLang's own default is 0): one spare slot per EP rank, as DeepSeek-V3's
        # EP32 prefill deploys 32 redundant experts, one per GPU (DeepSeek-V3 technical report, section 3.4.1), so
        # the balancer can copy the hottest experts onto every rank.
        wanted = int(named) if named else ep
        redundant = -(-wanted // ep) * ep if ep > 1 else wanted
        flags.append(f"--enable-eplb --ep-num-redundant-experts {redundant}")
        iterations = flag_value(cell.flags, "--eplb-rebalance-num-iterations")
        if iterations:
            flags.append(f"--eplb-rebalance-num-iterations {iterations}")
        source = (f"the cell's --ep-num-redundant-experts {named}" if named else "the cell names none: one per EP rank")
        notes.append(f"EPLB as the cell enables it: {redundant} redundant expert slots ({source}"
                     + (f", rounded up to a multiple of EP{ep}" if named and redundant != wanted else "")
                     + "), their copies counted in kestrel's weights per rank")
    return replace(layout, ep=ep, a2a=a2a, redundant_experts=redundant), flags, notes


def _kestrel_gpu(cell: sglang_recipe.SGLangCell, request: RecipeRequest, sglang_plan: Plan) -> EngineCommand:
    """kestrel's command for the SGLang cell's layout and memory settings, planned by kestrel's own engine
    arithmetic; RecipeRefused when kestrel cannot run it (the reason names what is missing)."""
    rules = _kestrel_rules()
    hardware = anchors()["hardware"][cell.hardware_key]
    quant = request.quant or sglang_recipe.default_quant(request.hardware)
    planned = sglang_plan.request
    layout, moe_flags, moe_notes = kestrel_moe(cell, planned.layout)
    refusals = [(hardware["family"] != "nvidia", rules["unsupported"]["hardware"].format(hardware=request.hardware)),
                (request.spec != "none", rules["unsupported"]["spec"]),
                (quant != "mxfp4", rules["unsupported"]["quant"].format(quant=quant)),
                (request.hicache != "off" and layout.world > 1,
                 rules["unsupported"]["hicache_ranks"].format(layout=layout.describe()))]
    for refused, reason in refusals:
        if refused:
            raise RecipeRefused(reason + ".")
    try:
        kestrel_plan = plan(replace(planned, engine="kestrel", layout=layout, max_mamba_cache_size=None,
                                    compare_devices=False))
    except ValueError as e:
        raise RecipeRefused(f"kestrel's engine cannot run {layout.describe()}: {str(e).rstrip('.')}.") from e
    if not kestrel_plan.fits:
        raise RecipeRefused(f"kestrel's plan of {layout.describe()} does not fit: {kestrel_plan.fit_reason}.")
    ratio = ratio_text(kestrel_plan.ratio)
    folder = f"models/{cell.model_path.rsplit('/', 1)[-1]}"
    extra, router, pd_notes = _hicache_flags(request.hicache), [], []
    if request.mode != "unified":
        pd = rules["pd"]
        extra.append(pd["role_flags"][request.mode])
        router = [pd["gpu_router"]]
        halves = {mode: replace(request, mode=mode).id for mode in ("prefill", "decode")}
        pd_notes = [pd["gpu_note"].format(**halves), *_handoff_note(kestrel_plan)]
    extra.append(f"--host 0.0.0.0 --port {rules['port']}")
    if cell.nodes > 1:
        extra.append(anchors()["sglang"]["multinode_flags"].format(nodes=cell.nodes))
    pools = kestrel_plan.pools
    summary = (f"kestrel's plan per rank: {kestrel_plan.weight_bytes_per_rank_total / 1e9:.1f} GB of weights, "
               f"{pools.state_slots:,} state slots, {pools.kv_tokens:,} KV tokens (ratio {ratio}, S = 1)")
    return EngineCommand(lines=[rules["download"].format(hf=cell.model_path, folder=folder),
                                _kestrel_serve(folder, "cuda", kestrel_plan, ratio, extra, moe_flags), *router],
                         strategy=f"{layout.describe()} on {cell.nodes} x {cell.per_node}",
                         notes=[summary, *moe_notes, rules["radix_note"], rules["gpu_note"], *pd_notes]
                         + (["run the same command on every node with its own --node-rank"] if cell.nodes > 1 else []))


def make_recipe(request: RecipeRequest) -> Recipe:
    """The recipe for `request`; RecipeRefused (a ValueError) when the anchors do not offer it."""
    request.check()
    if request.hardware == CPU:
        return _kestrel_cpu(request)
    cell = sglang_recipe.compose(request)
    recipe_plan = plan(sglang_recipe.plan_request(cell, request))
    ratio = ratio_text(recipe_plan.ratio)
    commands, refusals = {}, {}
    try:
        commands["kestrel"] = _kestrel_gpu(cell, request, recipe_plan)
    except RecipeRefused as refused:
        refusals["kestrel"] = str(refused).rstrip(".")
    commands["sglang"] = _sglang_command(cell, request, ratio)
    try:
        vllm = vllm_recipe.compose(request, cell)
        commands["vllm"] = EngineCommand(lines=vllm.lines, strategy=vllm.strategy, notes=vllm.notes)
    except RecipeRefused as refused:
        refusals["vllm"] = str(refused).rstrip(".")
    return Recipe(request=request, plan=recipe_plan, ratio_text=ratio, lane=cell.label, nodes=cell.nodes,
                  per_node=cell.per_node, sglang_status=cell.status, commands=commands, refusals=refusals,
                  notes=_recipe_notes(cell, request, recipe_plan))


def _offered(request: RecipeRequest) -> bool:
    try:
        sglang_recipe.compose(request)
    except RecipeRefused:
        return False
    return True


def base_requests(models: tuple[str, ...] = ("k3", "k3.1-pro"), cpu: bool = True) -> list[RecipeRequest]:
    """Every lane the anchors offer with default options (no HiCache, default checkpoint; no speculation, or DSPARK
    where the page offers nothing else: the NPU recipes), in the order of the anchor cells, then the CPU recipes (one
    device per instance: Unified and each PD role)."""
    requests = []
    devices = [d for entry in anchors()["hardware"].values() for d in entry["catalog"]]
    for model, device, mode, strategy in itertools.product(models, devices, MODES, STRATEGIES):
        for spec in ("none", "mtp"):
            request = RecipeRequest(model=model, hardware=device, mode=mode, strategy=strategy, spec=spec)
            if _offered(request):
                requests.append(request)
                break
    if cpu:
        requests += [RecipeRequest(model=m, hardware=CPU, mode=mode) for m in anchors()["kestrel"]["cpu_models"]
                     for mode in MODES]
    return requests
