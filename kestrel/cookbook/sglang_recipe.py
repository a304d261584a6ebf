"""SGLang's launch command for a recipe: the anchor cell of SGLang's Kimi-K3 page with the page's overlays
(speculation, HiCache, quantization) applied the way the page applies them (serving-recipes.md section 1).

A combination the page does not offer raises RecipeRefused with the page's reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .anchors import anchors, calculator_constants
from .calculator import CacheSettings
from .flags import Flags, drop_flags, flag_value, has_flag, merge_flags, parse_flags, render_flags, set_flag
from .layout import Layout
from .planner import PlanRequest

if TYPE_CHECKING:
    from .recipes import RecipeRequest


class RecipeRefused(ValueError):
    """The anchors do not support this combination; the message says why."""


@dataclass(frozen=True)
class SGLangCell:
    """An anchor cell with its overlays applied."""

    hardware_key: str                 # the anchors' hardware key: b300, mi35x, a3, ...
    label: str                        # SGLang's name for the lane
    flags: Flags
    env: list[str]
    image: str
    model_path: str
    nodes: int
    per_node: int
    status: str                       # the badge SGLang's page shows
    pins_mamba_cache_size: bool       # the Atlas A3 cell sizes the state pool with --max-mamba-cache-size
    notes: list[str] = field(default_factory=list)

    @property
    def npu(self) -> bool:
        return self.hardware_key in ("a3", "a5")

    @property
    def layout(self) -> Layout:
        dp = int(flag_value(self.flags, "--dp-size") or 1) if has_flag(self.flags, "--enable-dp-attention") else 1
        sizes = {name: int(flag_value(self.flags, f"--{name}-size") or 1) for name in ("tp", "ep", "pp", "dcp")}
        return Layout(dp=dp, **sizes)


def hardware_key(device_id: str) -> str | None:
    """The anchors' hardware entry covering catalog device `device_id`."""
    for key, entry in anchors()["hardware"].items():
        if device_id in entry["catalog"]:
            return key
    return None


def supported_devices() -> list[str]:
    return [d for entry in anchors()["hardware"].values() for d in entry["catalog"]]


def _model_entry(model: str) -> dict[str, Any]:
    models = anchors()["models"]
    if model not in models:
        raise RecipeRefused(f"the anchors hold recipes for {', '.join(models)} only; use `kestrel plan --model "
                            f"{model}` for its memory plan.")
    return models[model]


def _cell_strategy(request: RecipeRequest, key: str) -> str:
    entry = _model_entry(request.model)
    lane = f"{key}/{request.mode}/{request.strategy}"
    if lane in entry.get("refused_strategies", {}):
        raise RecipeRefused(entry["refused_strategies"][lane] + ".")
    if lane in entry.get("renamed_strategies", {}):
        return entry["renamed_strategies"][lane]
    if request.strategy == "high-concurrency":
        raise RecipeRefused(f"{request.model}'s SGLang page has no High-Concurrency lane on {request.hardware} "
                            f"{request.mode}; K3's TP x DCP lane is called Balanced.")
    return request.strategy


def _find_cell(request: RecipeRequest, key: str, strategy: str) -> dict[str, Any]:
    cells = [c for c in anchors()["cells"] if c["hw"] == key and c["mode"] == request.mode]
    for cell in cells:
        if cell["strategy"] == strategy:
            return cell
    offered = ", ".join(c["strategy"] for c in cells) or "none"
    raise RecipeRefused(f"SGLang's Kimi-K3 page has no {request.mode} {strategy} cell for {request.hardware} "
                        f"(its {request.mode} strategies there: {offered}).")


def _base(request: RecipeRequest, key: str) -> SGLangCell:
    cell = _find_cell(request, key, _cell_strategy(request, key))
    sglang, hardware = anchors()["sglang"], anchors()["hardware"][key]
    flags = parse_flags(cell["flags"].replace("{b200_extras}", sglang["b200_extras"]))
    if request.mode == "prefill":
        flags = merge_flags(flags, parse_flags(sglang["prefill_flags"]))
    elif request.mode == "decode":
        flags = merge_flags(flags, parse_flags(sglang["decode_flags"]))
        if hardware["blackwell"]:
            flags = merge_flags(flags, parse_flags(sglang["decode_blackwell_flags"]))
    image = sglang["images"]["nvidia" if hardware["family"] == "nvidia" else hardware["family"]]
    model = _model_entry(request.model)
    notes = [n for n in (cell.get("note"), cell.get("env_note"), hardware.get("layout_note"), model.get("anchor_note"))
             if n]
    lane = f"{key}/{request.mode}/{request.strategy}"
    status = model["statuses"].get(lane, model["default_status"]) if "default_status" in model else cell["status"]
    return SGLangCell(hardware_key=key, label=cell.get("sglang_name", request.strategy), flags=flags,
                      env=list(cell.get("env", [])), image=image, model_path=model["hf"],
                      nodes=cell.get("nodes", hardware["nodes"]), per_node=hardware["per_node"], status=status,
                      pins_mamba_cache_size=cell.get("pins_mamba_cache_size", False), notes=notes)


def _collapse_pipeline(cell: SGLangCell) -> SGLangCell:
    """SGLang's specCollapsePp for B200 Unified: PP2 x TP8 becomes TP16 (DCP and EP scale with it)."""
    pp = cell.layout.pp
    flags = drop_flags(cell.flags, "--pp-size")
    for name in ("--tp-size", "--dcp-size", "--ep-size"):
        if has_flag(flags, name):
            flags = set_flag(flags, name, str(int(flag_value(flags, name)) * pp))
    return replace(cell, flags=flags, notes=[*cell.notes, "DSPARK needs --pp-size 1: SGLang re-lays PP2 x TP8 "
                                                          "flat as TP16"])


def _with_spec(cell: SGLangCell, request: RecipeRequest) -> SGLangCell:
    sglang = anchors()["sglang"]
    if request.spec == "none":
        extra = sglang["non_spec_env"].get(anchors()["hardware"][cell.hardware_key]["family"], [])
        return replace(cell, env=[*cell.env, *extra])
    spec = _model_entry(request.model)["spec"]
    draft = spec.get(request.spec)
    if draft is None:
        raise RecipeRefused(spec.get(f"{request.spec}_refusal", f"no {request.spec} draft is recorded") + ".")
    layout = cell.layout
    if request.spec == "dflash":
        if cell.hardware_key in sglang["dflash_disabled_on"] or layout.pp > 1 or layout.dp > 1:
            raise RecipeRefused(sglang["dflash_disabled_reason"] + ".")
    elif layout.pp > 1:
        if cell.hardware_key != "b200" or request.mode != "unified":
            raise RecipeRefused("DSPARK needs --pp-size 1 and SGLang's page re-lays only B200 Unified cells flat; "
                                "this cell is pipelined.")
        cell = _collapse_pipeline(cell)
    flags = [("--speculative-algorithm", [draft["algorithm"]]), ("--speculative-draft-model-path", [draft["draft"]])]
    if draft["block_flag"]:
        flags.append((draft["block_flag"], [str(draft["draft_tokens"])]))
    if request.mode != "prefill" and not cell.npu:
        flags.append((sglang["spec_replay_flag"], []))
    if cell.npu:
        flags += parse_flags(sglang["npu_dspark_flags"])
    notes = [draft["note"]] if draft.get("note") else []
    return replace(cell, flags=merge_flags(cell.flags, flags), notes=[*cell.notes, *notes])


def _with_hicache(cell: SGLangCell, request: RecipeRequest) -> SGLangCell:
    if request.hicache == "off":
        return cell
    hicache = anchors()["sglang"]["hicache"]
    if cell.hardware_key in hicache["refused_on"]:
        raise RecipeRefused(hicache["refusal"] + ".")
    tier = hicache[request.hicache]
    flags = merge_flags(cell.flags, parse_flags(tier["flags"]))
    drops_dcp = request.hicache == "host+storage" or request.spec not in ("none", "mtp")
    if drops_dcp and cell.layout.dcp > 1:
        flags = drop_flags(flags, "--dcp-size", "--dcp-comm-backend")
    return replace(cell, flags=flags, env=[*cell.env, *tier["env"]], notes=[*cell.notes, tier["note"]])


def _with_quant(cell: SGLangCell, request: RecipeRequest, quant: str) -> SGLangCell:
    rules = anchors()["sglang"]["quantization"][quant]
    if cell.hardware_key in rules.get("refused_on", []) or cell.hardware_key not in rules.get("only_on",
                                                                                              [cell.hardware_key]):
        raise RecipeRefused(rules["refusal"] + ".")
    if quant == "mxfp4":
        return cell
    model_path = _model_entry(request.model).get(quant)
    if not model_path:
        raise RecipeRefused(f"no {rules['label']} checkpoint of {request.model} is recorded.")
    if quant == "w4a8":
        return replace(cell, model_path=model_path)
    flags = merge_flags(drop_flags(cell.flags, "--moe-runner-backend"), parse_flags(rules["moe_runner"]))
    return replace(cell, flags=flags, model_path=model_path, image=anchors()["sglang"]["images"]["nvfp4"],
                   notes=[*cell.notes, rules["note"]])


def default_quant(device_id: str) -> str:
    key = hardware_key(device_id)
    return anchors()["sglang"]["default_quant"].get(key or "", "mxfp4")


def compose(request: RecipeRequest) -> SGLangCell:
    """The SGLang cell for `request` with every overlay applied; RecipeRefused when the page does not offer it."""
    key = hardware_key(request.hardware)
    if key is None:
        raise RecipeRefused(f"SGLang's Kimi-K3 page has no recipe for {request.hardware} (it covers: "
                            f"{', '.join(supported_devices())}); `kestrel plan --hardware {request.hardware}` still "
                            "answers the memory questions.")
    if anchors()["hardware"][key].get("npu") and request.mode != "unified":
        raise RecipeRefused("only Unified PD is supported on the NPU recipes (SGLang page).")
    cell = _base(request, key)
    cell = _with_quant(cell, request, request.quant or default_quant(request.hardware))
    cell = _with_spec(cell, request)
    return _with_hicache(cell, request)


def plan_request(cell: SGLangCell, request: RecipeRequest) -> PlanRequest:
    """The plan of the command's own settings, read back from its flags as SGLang's calculator reads them."""
    flags = cell.flags
    strategy = "off" if has_flag(flags, "--disable-radix-cache") else (
        flag_value(flags, "--mamba-radix-cache-strategy") or "extra_buffer")
    spec = "none" if not has_flag(flags, "--speculative-algorithm") else request.spec
    draft = anchors()["models"][request.model]["spec"].get(spec) if spec != "none" else None
    cache = CacheSettings(
        kv_dtype="fp8" if flag_value(flags, "--kv-cache-dtype") == "fp8_e4m3" else "bf16",
        ssm_dtype="bf16" if flag_value(flags, "--mamba-ssm-dtype") in ("bfloat16", "float16") else "fp32",
        radix_strategy=strategy, overlap_schedule=not has_flag(flags, "--disable-overlap-schedule"),
        skip_decode_lock="SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1" in cell.env, mode=request.mode, spec=spec,
        draft_tokens=draft["draft_tokens"] if draft else 0,
        replay_ssm=has_flag(flags, anchors()["sglang"]["spec_replay_flag"]))
    fraction = flag_value(flags, "--mem-fraction-static")
    running = flag_value(flags, "--max-running-requests")
    return PlanRequest(model=request.model, hardware=request.hardware, layout=cell.layout, nodes=cell.nodes,
                       cache=cache, hicache=request.hicache, avg_request_len=request.avg_request_len,
                       mem_fraction=float(fraction) if fraction else calculator_constants()["default_mem_fraction"],
                       max_running_requests=int(running) if running else None)


def commands(cell: SGLangCell, mode: str, ratio_text: str) -> list[str]:
    """The launch line (one per node role: every node runs it with its own --node-rank)."""
    sglang = anchors()["sglang"]
    flags = cell.flags if cell.pins_mamba_cache_size else set_flag(cell.flags, "--mamba-full-memory-ratio",
                                                                    ratio_text)
    common = sglang["common_flags"].format(model=cell.model_path, port=sglang["ports"][mode])
    parts = [sglang["binary"], common]
    if cell.nodes > 1:
        parts.append(sglang["multinode_flags"].format(nodes=cell.nodes))
    flags = [(name, [v.replace("{model}", cell.model_path) for v in values]) for name, values in flags]
    parts.append(render_flags(flags))
    env = " ".join(cell.env)
    return [" ".join([env, *parts]) if env else " ".join(parts)]


def router_command() -> str:
    return anchors()["sglang"]["router"]
