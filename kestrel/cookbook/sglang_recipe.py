"""SGLang's launch command for a recipe: the anchor cell of SGLang's Kimi-K3 page (or, for K3.1 Pro, the lanes its
own page names) with the page's overlays (speculation, HiCache, quantization) applied the way the page applies them
(serving-recipes.md sections 1 and 5).

A combination the page does not offer raises RecipeRefused with the page's reason; a K3.1 Pro lane whose cell the
reference did not recover is refused as unknown, never filled in from K3's page.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .anchors import anchors, calculator_constants
from .calculator import CacheSettings
from .flags import Flags, drop_flags, flag_value, has_flag, merge_flags, parse_flags, render_flags, set_flag
from .layout import Layout
from .planner import PlanRequest
from .recipe_request import RecipeRefused, RecipeRequest

REPLAY_FLAG = "--enable-linear-replayssm-spec"


@dataclass(frozen=True)
class SGLangCell:
    """An anchor cell with its overlays applied."""

    hardware_key: str                 # the anchors' hardware key: b300, mi35x, a3, ...
    label: str                        # SGLang's name for the lane
    flags: Flags
    env: list[str]
    image: str | None                 # None: the page's image for this model and hardware is not known
    model: str                        # the anchors' model key
    model_path: str
    nodes: int
    per_node: int
    status: str                       # the badge SGLang's page shows
    notes: list[str] = field(default_factory=list)

    @property
    def npu(self) -> bool:
        return self.hardware_key in ("a3", "a5")

    @property
    def pins_mamba_cache_size(self) -> bool:
        """Whether the cell sizes the state pool by count (--max-mamba-cache-size, the Atlas A3) instead of a ratio."""
        return has_flag(self.flags, "--max-mamba-cache-size")

    @property
    def dp_attention(self) -> bool:
        return has_flag(self.flags, "--enable-dp-attention")

    @property
    def layout(self) -> Layout:
        dp = int(flag_value(self.flags, "--dp-size") or 1) if self.dp_attention else 1
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


def page_settings(model: str) -> dict[str, Any]:
    """The anchors' SGLang settings with the model's own page overriding them (K3.1 Pro's image, PD flags, ...)."""
    return {**anchors()["sglang"], **_model_entry(model).get("sglang", {})}


def _missing_lane(request: RecipeRequest, offered: list[str]) -> RecipeRefused:
    """Why the model's page has no cell for the request's lane (offered: the strategies it has there)."""
    entry = _model_entry(request.model)
    if "unknown_lane" in entry:
        return RecipeRefused(entry["unknown_lane"].format(mode=request.mode, strategy=request.strategy,
                                                          hardware=request.hardware) + ".")
    if request.strategy == "high-concurrency":
        return RecipeRefused(f"{request.model}'s SGLang page has no High-Concurrency lane on {request.hardware} "
                             f"{request.mode}; K3's TP x DCP lane is called Balanced.")
    return RecipeRefused(f"SGLang's Kimi-K3 page has no {request.mode} {request.strategy} cell for "
                         f"{request.hardware} (its {request.mode} strategies there: {', '.join(offered) or 'none'}).")


def _find_cell(request: RecipeRequest, key: str) -> dict[str, Any]:
    refused = _model_entry(request.model).get("refused_strategies", {})
    lane = f"{key}/{request.mode}/{request.strategy}"
    if lane in refused:
        raise RecipeRefused(refused[lane] + ".")
    cells = [c for c in anchors()["cells"]
             if c.get("model", "k3") == request.model and c["hw"] == key and c["mode"] == request.mode]
    for cell in cells:
        if cell["strategy"] == request.strategy:
            return cell
    raise _missing_lane(request, [c["strategy"] for c in cells])


def _cell_flags(cell: dict[str, Any], settings: dict[str, Any], mode: str, blackwell: bool) -> Flags:
    """The cell's flags with the page's shared pieces expanded and the PD role's flags merged in."""
    text = (cell["flags"].replace("{b200_extras}", settings["b200_extras"])
            .replace("{deep_pp_prefill}", settings["deep_pp_prefill_flags"]))
    flags = merge_flags([], parse_flags(text))
    role = {"prefill": [settings["prefill_flags"]],
            "decode": [settings["decode_flags"], settings["decode_blackwell_flags"] if blackwell else ""]}
    for extra in role.get(mode, []):
        if extra:
            flags = merge_flags(flags, parse_flags(extra))
    return flags


def _image(settings: dict[str, Any], family: str) -> tuple[str | None, list[str]]:
    """The page's image for the hardware family, or None with the reason."""
    image = settings["images"].get(family)
    return (image, []) if image else (None, [settings["image_unknown"]])


def _base(request: RecipeRequest, key: str) -> SGLangCell:
    cell = _find_cell(request, key)
    settings, hardware, model = page_settings(request.model), anchors()["hardware"][key], _model_entry(request.model)
    image, image_notes = _image(settings, hardware["family"])
    notes = [n for n in (cell.get("note"), cell.get("env_note"), hardware.get("layout_note"), model.get("cell_note"))
             if n]
    lane = f"{key}/{request.mode}/{request.strategy}"
    status = model["statuses"].get(lane, model["default_status"]) if "default_status" in model else cell["status"]
    return SGLangCell(hardware_key=key, label=cell.get("sglang_name", request.strategy),
                      flags=_cell_flags(cell, settings, request.mode, hardware["blackwell"]),
                      env=list(cell.get("env", [])), image=image, model=request.model, model_path=model["hf"],
                      nodes=cell.get("nodes", hardware["nodes"]), per_node=hardware["per_node"], status=status,
                      notes=[*notes, *image_notes])


def _collapse_pipeline(cell: SGLangCell) -> SGLangCell:
    """SGLang's specCollapsePp for B200 Unified: PP2 x TP8 becomes TP16 (DCP and EP scale with it)."""
    pp = cell.layout.pp
    flags = drop_flags(cell.flags, "--pp-size")
    for name in ("--tp-size", "--dcp-size", "--ep-size"):
        if has_flag(flags, name):
            flags = set_flag(flags, name, str(int(flag_value(flags, name)) * pp))
    return replace(cell, flags=flags, notes=[*cell.notes, "DSPARK needs --pp-size 1: SGLang re-lays PP2 x TP8 "
                                                          "flat as TP16"])


def _draft(request: RecipeRequest) -> dict[str, Any]:
    spec = _model_entry(request.model)["spec"]
    draft = spec.get(request.spec)
    if draft is None:
        raise RecipeRefused(spec.get(f"{request.spec}_refusal", f"no {request.spec} draft is recorded") + ".")
    return draft


def _check_spec_layout(cell: SGLangCell, request: RecipeRequest) -> SGLangCell:
    """The cell laid out for speculation (B200 Unified re-laid flat), or RecipeRefused with the page's reason."""
    settings = page_settings(request.model)
    if request.spec == "dflash":
        if cell.hardware_key in settings["dflash_disabled_on"] or cell.layout.pp > 1 or cell.dp_attention:
            raise RecipeRefused(settings["dflash_disabled_reason"] + ".")
        return cell
    if cell.layout.pp == 1:
        return cell
    if cell.hardware_key != "b200" or request.mode != "unified":
        raise RecipeRefused("DSPARK needs --pp-size 1 and SGLang's page re-lays only B200 Unified cells flat; this "
                            "cell is pipelined.")
    return _collapse_pipeline(cell)


def _with_spec(cell: SGLangCell, request: RecipeRequest) -> SGLangCell:
    settings = page_settings(request.model)
    if request.spec == "none":
        if cell.npu:
            raise RecipeRefused(settings["npu_spec_refusal"] + ".")
        extra = settings["non_spec_env"].get(anchors()["hardware"][cell.hardware_key]["family"], [])
        return replace(cell, env=[*cell.env, *extra])
    draft = _draft(request)
    cell = _check_spec_layout(cell, request)
    flags = [("--speculative-algorithm", [draft["algorithm"]]), ("--speculative-draft-model-path", [draft["draft"]])]
    if draft["block_flag"]:
        flags.append((draft["block_flag"], [str(draft["draft_tokens"])]))
    if request.mode != "prefill" and not cell.npu and settings["spec_replay_flag"]:
        flags.append((settings["spec_replay_flag"], []))
    if cell.npu:
        flags += parse_flags(settings["npu_dspark_flags"])
    notes = [draft["note"]] if draft.get("note") else []
    return replace(cell, flags=merge_flags(cell.flags, flags), notes=[*cell.notes, *notes])


def _refuse_overlay(request: RecipeRequest, overlay: str) -> None:
    """RecipeRefused when the model's page does not record `overlay` (K3.1 Pro's HiCache and NVFP4)."""
    reason = _model_entry(request.model).get("overlay_refusals", {}).get(overlay)
    if reason:
        raise RecipeRefused(reason + ".")


def _with_hicache(cell: SGLangCell, request: RecipeRequest) -> SGLangCell:
    if request.hicache == "off":
        return cell
    _refuse_overlay(request, "hicache")
    hicache = page_settings(request.model)["hicache"]
    if cell.hardware_key in hicache["refused_on"]:
        raise RecipeRefused(hicache["refusal"] + ".")
    tier = hicache[request.hicache]
    flags = merge_flags(cell.flags, parse_flags(tier["flags"]))
    drops_dcp = request.hicache == "host+storage" or request.spec not in ("none", "mtp")
    if drops_dcp and cell.layout.dcp > 1:
        flags = drop_flags(flags, "--dcp-size", "--dcp-comm-backend")
    notes = [tier["note"], *([hicache["decode_note"]] if request.mode == "decode" else [])]
    return replace(cell, flags=flags, env=[*cell.env, *tier["env"]], notes=[*cell.notes, *notes])


def _with_quant(cell: SGLangCell, request: RecipeRequest, quant: str) -> SGLangCell:
    settings = page_settings(request.model)
    rules = settings["quantization"][quant]
    if cell.hardware_key in rules.get("refused_on", []) or cell.hardware_key not in rules.get("only_on",
                                                                                              [cell.hardware_key]):
        raise RecipeRefused(rules["refusal"] + ".")
    if quant == "mxfp4":
        return cell
    _refuse_overlay(request, quant)
    model_path = _model_entry(request.model).get(quant)
    if not model_path:
        raise RecipeRefused(f"no {rules['label']} checkpoint of {request.model} is recorded.")
    if quant == "w4a8":
        return replace(cell, model_path=model_path)
    flags = merge_flags(drop_flags(cell.flags, "--moe-runner-backend"), parse_flags(rules["moe_runner"]))
    return replace(cell, flags=flags, model_path=model_path, image=settings["images"]["nvfp4"],
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
    """The plan of the command's own settings, read back from its flags as SGLang's runtime reads them."""
    flags = cell.flags
    strategy = "off" if has_flag(flags, "--disable-radix-cache") else (
        flag_value(flags, "--mamba-radix-cache-strategy") or "extra_buffer")
    spec = "none" if not has_flag(flags, "--speculative-algorithm") else request.spec
    cache = CacheSettings(
        kv_dtype="fp8" if flag_value(flags, "--kv-cache-dtype") == "fp8_e4m3" else "bf16",
        ssm_dtype="bf16" if flag_value(flags, "--mamba-ssm-dtype") in ("bfloat16", "float16") else "fp32",
        radix_strategy=strategy, overlap_schedule=not has_flag(flags, "--disable-overlap-schedule"),
        skip_decode_lock="SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1" in cell.env, mode=request.mode, spec=spec,
        replay_ssm=has_flag(flags, REPLAY_FLAG))
    return PlanRequest(model=request.model, hardware=request.hardware, layout=cell.layout, nodes=cell.nodes,
                       cache=cache, hicache=request.hicache, avg_request_len=request.avg_request_len,
                       mem_fraction=float(_count(flags, "--mem-fraction-static", float)
                                          or calculator_constants()["default_mem_fraction"]),
                       max_running_requests=_count(flags, "--max-running-requests", int),
                       max_mamba_cache_size=_count(flags, "--max-mamba-cache-size", int))


def _count(flags: Flags, name: str, kind: type) -> Any:
    value = flag_value(flags, name)
    return kind(value) if value else None


def _common_flags(cell: SGLangCell, mode: str) -> Flags:
    """The flags every cell carries (parsers, host, port); the NPU recipes hide --tool-call-parser."""
    settings = page_settings(cell.model)
    flags = parse_flags(settings["common_flags"].format(model=cell.model_path, port=settings["ports"][mode]))
    return drop_flags(flags, *settings["npu_hidden_flags"]) if cell.npu else flags


def commands(cell: SGLangCell, mode: str, ratio_text: str) -> list[str]:
    """The launch line (one per node role: every node runs it with its own --node-rank)."""
    settings = page_settings(cell.model)
    flags = cell.flags if cell.pins_mamba_cache_size else set_flag(cell.flags, "--mamba-full-memory-ratio",
                                                                    ratio_text)
    parts = [settings["binary"], render_flags(_common_flags(cell, mode))]
    if cell.nodes > 1:
        parts.append(settings["multinode_flags"].format(nodes=cell.nodes))
    flags = [(name, [v.replace("{model}", cell.model_path) for v in values]) for name, values in flags]
    parts.append(render_flags(flags))
    return [" ".join([*cell.env, *parts])]


def router_command(model: str) -> str:
    """The PD router of the model's page."""
    return page_settings(model)["router"]
