"""vLLM's launch command for a recipe: the strategy of vLLM's Kimi-K3 recipe that matches the lane, its
per-hardware arguments and parsers as published (serving-recipes.md section 6), with the parallelism of the
matching SGLang cell's node layout spelled in vLLM's standard flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .anchors import anchors
from .flags import merge_flags, parse_flags, render_flags
from .sglang_recipe import RecipeRefused, SGLangCell

if TYPE_CHECKING:
    from .recipes import RecipeRequest


@dataclass(frozen=True)
class VLLMCommand:
    strategy: str                 # the vLLM recipe's strategy name
    command: str
    notes: list[str]


def _family(cell: SGLangCell) -> str:
    hardware = anchors()["hardware"][cell.hardware_key]
    return "amd" if hardware["family"] == "amd" else ("blackwell" if hardware["blackwell"] else "hopper")


def _lane(request: RecipeRequest, cell: SGLangCell, gpus: int) -> dict:
    """The vLLM strategy for the lane at the SGLang cell's GPU count."""
    vllm = anchors()["vllm"]
    if request.mode == "unified" and request.strategy == "low-latency" and cell.layout.pp > 1:
        if request.hardware not in vllm["pp_lane"]["hardware"]:
            raise RecipeRefused("vLLM's recipe has no pipelined strategy for this hardware.")
        return vllm["pp_lane"]
    key = request.mode if request.mode != "unified" else f"unified/{request.strategy}"
    for lane in vllm["lanes"].get(key, []):
        if lane.get("min_gpus", 1) <= gpus <= lane.get("max_gpus", gpus):
            return lane
    raise RecipeRefused(f"vLLM's K3 recipe has no strategy for the {request.mode} {request.strategy} lane on "
                        f"{gpus} GPUs.")


def compose(request: RecipeRequest, cell: SGLangCell) -> VLLMCommand:
    """vLLM's command for the lane of `cell`, or RecipeRefused with the reason vLLM's recipe does not cover it."""
    vllm = anchors()["vllm"]
    model = anchors()["models"][request.model]
    if not model["vllm"]:
        raise RecipeRefused(model["vllm_refusal"] + ".")
    if request.hardware not in vllm["hardware"]:
        raise RecipeRefused(vllm["hardware_refusal"] + ".")
    if request.hicache != "off":
        raise RecipeRefused(vllm["hicache_refusal"] + ".")
    if request.spec == "dflash":
        raise RecipeRefused(vllm["dflash_refusal"] + ".")
    quant = request.quant or "mxfp4"
    if quant not in ("mxfp4", "nvfp4"):
        raise RecipeRefused(f"vLLM's K3 recipe has no {quant} variant (it has MXFP4 and NVFP4).")
    gpus = cell.nodes * cell.per_node
    lane = _lane(request, cell, gpus)
    family = vllm["families"][_family(cell)]
    flags = merge_flags(parse_flags(vllm["base_flags"]), parse_flags(family["flags"]))
    flags = merge_flags(flags, parse_flags(lane["flags"].format(gpus=gpus)))
    if lane.get("gb_moe_backend") and request.hardware in ("gb200", "gb300"):
        flags = merge_flags(flags, parse_flags(lane["gb_moe_backend"]))
    if request.spec == "mtp":
        if "--pipeline-parallel-size" in dict(flags):
            raise RecipeRefused(vllm["mtp_refused_with_pp"] + ".")
        flags = merge_flags(flags, parse_flags(vllm["mtp"]))
    checkpoint = model["hf"] if quant == "mxfp4" else model["vllm_nvfp4"]
    env = " ".join([*family["env"], *lane.get("env", [])])
    command = " ".join(part for part in (env, vllm["binary"], checkpoint, render_flags(flags)) if part)
    notes = [vllm["composition_note"]]
    if family.get("note"):
        notes.append(family["note"])
    if cell.nodes > 1:
        notes.append(f"{gpus} GPUs over {cell.nodes} nodes: the multi-node launch (Ray, or data-parallel ranks per "
                     "node) follows vLLM's recipe and is not recorded in the reference")
    return VLLMCommand(strategy=lane["strategy"], command=command, notes=notes)
