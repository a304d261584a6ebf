"""vLLM's launch command for a recipe: the strategy of vLLM's Kimi-K3 recipe that matches the lane, composed the
way the recipes site's command builder composes it (vllm-project/recipes src/lib/command-synthesis.js @8959cf64):
base arguments, the strategy's arguments and parallelism, the recipe's strategy overrides, the hardware family's
arguments (a strategy's own family override replaces them), exact-GPU arguments, then the features (tool calling,
reasoning, speculation). PD recipes disaggregate through NixlConnector and end with vllm-router's command. The GPU
count and node layout are those of the matching SGLang cell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .anchors import anchors
from .flags import Flags, merge_flags, parse_flags, render_flags
from .layout import Layout
from .planner import PlanRequest, plan
from .recipe_request import RecipeRefused, RecipeRequest
from .sglang_recipe import SGLangCell


@dataclass(frozen=True)
class VLLMCommand:
    strategy: str                 # the vLLM recipe's strategy name
    lines: list[str]              # the server command (and, for PD, the router)
    notes: list[str]


def _family(cell: SGLangCell) -> str:
    hardware = anchors()["hardware"][cell.hardware_key]
    return "amd" if hardware["family"] == "amd" else ("blackwell" if hardware["blackwell"] else "hopper")


def _strategy_name(request: RecipeRequest, cell: SGLangCell) -> str:
    """The vLLM strategy for the lane: single-node or multi-node by the SGLang cell's nodes, pipelined where the
    SGLang cell is (B200's PP2 x TP8)."""
    vllm = anchors()["vllm"]
    lane = vllm["lanes"].get(request.mode if request.mode != "unified" else f"unified/{request.strategy}")
    gpus = cell.nodes * cell.per_node
    if lane is None or gpus < lane.get("min_gpus", 1):
        raise RecipeRefused(f"vLLM's K3 recipe has no strategy for the {request.mode} {request.strategy} lane on "
                            f"{gpus} GPUs.")
    if "any" in lane:
        return lane["any"]
    if request.hardware in lane.get("hardware", {}):      # the recipe's strategy_hardware grants and opt-outs
        return lane["hardware"][request.hardware]
    if cell.layout.pp > 1 and "pipelined" in lane:
        if request.hardware not in vllm["pipelined_hardware"]:
            raise RecipeRefused("vLLM's recipe has no pipelined strategy for this hardware.")
        return lane["pipelined"]
    name = lane.get("single" if cell.nodes == 1 else "multi")
    if name is None:
        raise RecipeRefused(f"vLLM's K3 recipe has no single-node strategy for the {request.strategy} lane.")
    return name


def _nodes_and_gpus(kind: str, cell: SGLangCell) -> tuple[int, int]:
    """The pool's nodes and GPUs: the SGLang cell's, except the PD prefill pool, TEP over 8 GPUs."""
    if kind == "tep8":
        return -(-8 // cell.per_node), 8
    return cell.nodes, cell.nodes * cell.per_node


def _parallel_flags(kind: str, cell: SGLangCell, role: str | None) -> tuple[str, list[str]]:
    """The strategy's parallelism for the cell's node layout, and how to launch it on several nodes."""
    nodes, gpus = _nodes_and_gpus(kind, cell)
    rendezvous = f" --nnodes {nodes} --node-rank <rank> --master-addr <head-node-ip>" if nodes > 1 else ""
    workers = ["every node runs this command with its own --node-rank; add --headless on ranks above 0"] \
        if nodes > 1 else []
    if kind in ("tp", "tp_nodes"):
        return f"--tensor-parallel-size {gpus}{rendezvous}", workers
    if kind == "tep8":
        return f"--tensor-parallel-size {gpus} --enable-expert-parallel{rendezvous}", workers
    if kind == "tp_dp":           # one TP replica per node, DP across the nodes (vLLM's multi_node_tp_dp)
        flags = f"--tensor-parallel-size {cell.per_node}"
        if nodes == 1:
            return flags, []
        return (f"{flags} --data-parallel-size {nodes} --data-parallel-size-local 1 --data-parallel-address "
                "<head-node-ip> --data-parallel-start-rank <node-index>",
                ["one command per node (one replica each), each with its own --data-parallel-start-rank"])
    if kind == "tp_pp":
        return f"--tensor-parallel-size {cell.per_node} --pipeline-parallel-size {nodes}{rendezvous}", workers
    flags = (f"--data-parallel-size {gpus} --data-parallel-size-local {cell.per_node} "
             "--data-parallel-address <head-node-ip>")
    if role:
        flags += " --data-parallel-rpc-port <dp-rpc-port>"
    if nodes == 1:
        return f"{flags} --enable-expert-parallel", []
    return (f"{flags} --data-parallel-start-rank <node-index x {cell.per_node}> --enable-expert-parallel",
            ["one command per node, each with its own --data-parallel-start-rank"])


def _device(cell: SGLangCell) -> str:
    """The catalog device of a single-device anchors entry (gb200, gb300, ...), else the anchors' key."""
    devices = anchors()["hardware"][cell.hardware_key]["catalog"]
    return devices[0] if len(devices) == 1 else cell.hardware_key


def _family_settings(strategy: dict[str, Any], family: str) -> dict[str, Any]:
    """The family's arguments and environment; a strategy's own family override replaces them (the recipe's
    strategy_overrides.<s>.hardware_overrides.<family>)."""
    return strategy.get("family_override", {}).get(family, anchors()["vllm"]["families"][family])


def _strategy_flags(strategy: dict[str, Any], cell: SGLangCell, family: str) -> tuple[Flags, list[str]]:
    """Base, strategy and parallelism, strategy overrides, family, exact GPU; later settings of a flag win."""
    parallel, notes = _parallel_flags(strategy["parallel"], cell, strategy.get("role"))
    flags = parse_flags(anchors()["vllm"]["base_flags"])
    for text in (strategy.get("flags", ""), parallel, strategy.get("override_flags", ""),
                 _family_settings(strategy, family)["flags"], strategy.get("gpu_flags", {}).get(_device(cell), "")):
        if text:
            flags = merge_flags(flags, parse_flags(text))
    return flags, notes


def _env(strategy: dict[str, Any], cell: SGLangCell, family: str) -> list[str]:
    """The environment in the command builder's order (later settings of a name win); PD commands drop the
    NVL4-only names outside GB200/GB300."""
    vllm = anchors()["vllm"]
    nodes, _ = _nodes_and_gpus(strategy["parallel"], cell)
    env: dict[str, str] = {}
    for setting in (*(vllm["multinode_env"] if nodes > 1 else []), *strategy.get("env", []),
                    *strategy.get("override_env", []), *_family_settings(strategy, family)["env"]):
        name, _, value = setting.partition("=")
        env[name] = value
    if "role" in strategy and _device(cell) not in vllm["nvl4_hardware"]:
        env = {k: v for k, v in env.items() if k not in vllm["nvl4_only_env"]}
    return [f"{k}={v}" for k, v in env.items()]


def _features(request: RecipeRequest, strategy_name: str, family: str) -> Flags:
    vllm = anchors()["vllm"]
    flags = parse_flags(vllm["feature_flags"])
    if request.spec == "mtp":
        no_spec = vllm["strategies"][strategy_name].get("no_spec")
        if no_spec:
            raise RecipeRefused(no_spec + ".")
        flags = merge_flags(flags, parse_flags((vllm["mtp_amd"] + " " if family == "amd" else "") + vllm["mtp"]))
    return flags


def _check_offered(request: RecipeRequest) -> None:
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
    if (request.quant or "mxfp4") not in ("mxfp4", "nvfp4"):
        raise RecipeRefused(f"vLLM's K3 recipe has no {request.quant} variant (it has MXFP4 and NVFP4).")


def _check_replica_fits(request: RecipeRequest, cell: SGLangCell, name: str, strategy: dict[str, Any]) -> None:
    """RecipeRefused when the strategy puts a whole replica on one node (tp_dp) and kestrel's plan of that replica
    (TP over one node's devices, the checkpoint's weights) does not fit; a device of unknown memory is not refused."""
    if strategy["parallel"] != "tp_dp":
        return
    replica = plan(PlanRequest(model=request.model, hardware=request.hardware, layout=Layout(tp=cell.per_node),
                               compare_devices=False, batches=(1,)))
    if replica.fits is False:
        raise RecipeRefused(strategy["refusal"].format(
            strategy=name, hardware=request.hardware, tp=cell.per_node,
            weights=replica.weight_bytes_per_rank_total / 1e9,
            memory=replica.device.memory_bytes / 1e9) + ".")


def compose(request: RecipeRequest, cell: SGLangCell) -> VLLMCommand:
    """vLLM's command for the lane of `cell`, or RecipeRefused with the reason vLLM's recipe does not cover it."""
    _check_offered(request)
    vllm = anchors()["vllm"]
    family = _family(cell)
    name = _strategy_name(request, cell)
    strategy = vllm["strategies"][name]
    _check_replica_fits(request, cell, name, strategy)
    flags, notes = _strategy_flags(strategy, cell, family)
    flags = merge_flags(flags, _features(request, name, family))
    model = anchors()["models"][request.model]
    checkpoint = model["hf"] if (request.quant or "mxfp4") == "mxfp4" else model["vllm_nvfp4"]
    command = " ".join([*_env(strategy, cell, family), vllm["binary"], checkpoint, render_flags(flags)])
    lines = [command, vllm["pd_router"]] if "role" in strategy else [command]
    notes = [vllm["composition_note"], *notes]
    notes += [n for n in (vllm["families"][family].get("note"), vllm["pd_note"] if "role" in strategy else None) if n]
    return VLLMCommand(strategy=name, lines=lines, notes=notes)
