"""The claims ledger: public headline claims about serving this family (data/claims.json), each with a status
derived from evidence records and the planner only.

Reproduced: a record of ours matches it. Consistent: the roofline or memory plan allows it. Contradicted: they
rule it out (the reason carries the arithmetic). Unverified: no public source, or nothing here can check it.
Roofline checks count the fewest bytes any engine could read (k experts per layer, every weight split over the
TP group, the shortest stated context), so a Contradicted claim is ruled out under the most favourable reading.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from .calculator import CacheSettings
from .evidence import Record
from .hardware import Device, get_device
from .layout import Layout
from .model import ModelFacts, model_facts
from .planner import min_devices, plan
from .recipes import RecipeRequest, make_recipe
from .roofline import DecodeStep, decode_step

CLAIMS_FILE = Path(__file__).parent / "data" / "claims.json"
REPRODUCED, CONSISTENT, CONTRADICTED, UNVERIFIED = "Reproduced", "Consistent", "Contradicted", "Unverified"
STATUS_MEANINGS = {
    REPRODUCED: "a record of ours matches it",
    CONSISTENT: "the planner's decode roofline or memory plan allows it",
    CONTRADICTED: "the roofline or memory plan rules it out (the arithmetic is given)",
    UNVERIFIED: "no public source was found, or nothing here can check it",
}


@dataclass(frozen=True)
class LedgerRow:
    id: str
    claim: str
    source: str | None
    conditions: str
    status: str
    reason: str


@cache
def claims() -> list[dict[str, Any]]:
    return json.loads(CLAIMS_FILE.read_text())["claims"]


def _most_favourable_step(model: ModelFacts, device: Device, layout: Layout, settings: CacheSettings, batch: int,
                          context: int, tokens_per_step: int) -> DecodeStep:
    bandwidth = device.bandwidth_bytes_per_s / device.ranks_per_device
    devices = math.ceil(layout.world / device.ranks_per_device)
    return decode_step(model, layout, settings, bandwidth, devices, batch, context, tokens_per_step,
                       assumptions="most_favourable")


def _rate_verdict(claimed: float, step: DecodeStep, device: Device, what: str) -> tuple[str, str]:
    bound = step.tokens_per_s_per_user
    relation = "≤" if claimed <= bound else ">"
    reason = (f"{what} {relation} the roofline's {bound:,.0f} tok/s per user: at least {step.total_bytes / 1e9:.2f} GB "
              f"per rank per step ({step.tokens_per_sequence} token(s) per sequence, batch {step.batch}, context "
              f"{step.context:,}) at {device.bandwidth_bytes_per_s / 1e12:g} TB/s")
    return (CONSISTENT if claimed <= bound else CONTRADICTED), reason


def _check_tpot(check: dict) -> tuple[str, str]:
    recipe = make_recipe(RecipeRequest.from_id(check["recipe"]))
    request = recipe.plan.request
    step = _most_favourable_step(recipe.plan.model, recipe.plan.device, request.layout, request.cache,
                                 check["batch"], check["context"], check["tokens_per_step"])
    claimed = 1000 / check["tpot_ms"]
    return _rate_verdict(claimed, step, recipe.plan.device,
                         f"claimed {claimed:,.1f} tok/s per user (1000 / {check['tpot_ms']} ms)")


def _check_decode_rate(check: dict) -> tuple[str, str]:
    device = get_device(check["hardware"])
    step = _most_favourable_step(model_facts(check["model"]), device, Layout(**check["layout"]), CacheSettings(),
                                 check["batch"], check["context"], check["tokens_per_step"])
    return _rate_verdict(check["tokens_per_s_per_user"], step, device,
                         f"claimed {check['tokens_per_s_per_user']:,} tok/s per user")


def _recipe_plan(check: dict, **overrides: Any):
    """The plan of the check's recipe with `overrides`; "memory": "measured" plans with the memory a measurement saw
    on that device, for claims measured on real hardware."""
    recipe = make_recipe(RecipeRequest.from_id(check["recipe"]))
    if check.get("memory") == "measured":
        overrides["memory_bytes"] = recipe.plan.device.measured_memory_bytes
    return plan(replace(recipe.plan.request, **overrides))


def _memory_basis(check: dict, result) -> str:
    if check.get("memory") != "measured":
        return ""
    return f", memory as measured on {result.device.id}: {result.request.memory_bytes / 1e9:.1f} GB"


def _check_admission_cap(check: dict) -> tuple[str, str]:
    result = _recipe_plan(check, max_running_requests=check.get("max_running_requests"))
    bound = result.pools.max_running_requests
    status = CONSISTENT if check["cap"] <= bound else CONTRADICTED
    return status, (f"claimed {check['cap']} {'≤' if status == CONSISTENT else '>'} the planner's upper bound of "
                    f"{bound} requests ({result.weight_bytes_per_rank_total / 1e9:.1f} GB of weights per rank"
                    f"{_memory_basis(check, result)}, ratio {result.ratio:.3g}, {result.pools.state_slots} state slots "
                    f"of {result.state_bytes_per_slot_per_rank + result.ring_bytes_per_slot_per_rank:,} B, "
                    f"S = {result.slots_per_request})")


def _check_kv_capacity(check: dict) -> tuple[str, str]:
    result = _recipe_plan(check, ratio=check["ratio"])
    bound = result.pools.kv_tokens
    status = CONSISTENT if check["kv_tokens"] <= bound else CONTRADICTED
    return status, (f"claimed {check['kv_tokens']:,} KV tokens {'≤' if status == CONSISTENT else '>'} the planner's "
                    f"upper bound of {bound:,} at ratio {check['ratio']} "
                    f"({result.weight_bytes_per_rank_total / 1e9:.1f} GB of weights per rank)")


def _check_memory_fit(check: dict) -> tuple[str, str]:
    device = get_device(check["hardware"])
    needed = min_devices(model_facts(check["model"]), device, CacheSettings(), 0.85, 11264, 0)
    if needed is None:
        return UNVERIFIED, f"the memory of {device.id} is unknown"
    status = CONSISTENT if needed <= check["devices"] else CONTRADICTED
    return status, (f"the weights and one 11,264-token request need {needed} x {device.id} "
                    f"({device.fact('memory').describe()}) {'≤' if status == CONSISTENT else '>'} "
                    f"{check['devices']}; memory only, the bandwidth of {device.id} is "
                    f"{'unknown' if device.bandwidth_bytes_per_s is None else 'not checked'}")


def _check_record(check: dict, records: list[Record]) -> tuple[str, str]:
    """Reproduced when a record of the recipe has the metric within the relative tolerance."""
    values = []
    for record in records:
        if record.recipe != check["recipe"]:
            continue
        value: Any = record.as_dict()
        for key in check["metric"].split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, (int, float)):
            values.append(value)
    matching = [v for v in values if abs(v - check["value"]) <= check["tolerance"] * abs(check["value"])]
    if matching:
        return REPRODUCED, f"our record measured {check['metric']} = {matching[-1]:.4g} (claimed {check['value']})"
    if values:
        return UNVERIFIED, (f"our records measured {check['metric']} = {values[-1]:.4g}, outside "
                            f"{check['tolerance']:.0%} of the claimed {check['value']}")
    return UNVERIFIED, f"no record of {check['recipe']} yet"


_CHECKS = {"tpot": _check_tpot, "decode_rate": _check_decode_rate, "admission_cap": _check_admission_cap,
           "kv_capacity": _check_kv_capacity, "memory_fit": _check_memory_fit}


def evaluate(claim: dict[str, Any], records: list[Record]) -> LedgerRow:
    check = claim["check"]
    if claim["source"] is None:
        status, reason = UNVERIFIED, check.get("reason", "no public source was found")
    elif check["kind"] == "record":
        status, reason = _check_record(check, records)
    elif check["kind"] == "none":
        status, reason = UNVERIFIED, check["reason"]
    else:
        status, reason = _CHECKS[check["kind"]](check)
    return LedgerRow(id=claim["id"], claim=claim["claim"], source=claim["source"], conditions=claim["conditions"],
                     status=status, reason=reason)


def ledger_rows(records: list[Record], entries: list[dict[str, Any]] | None = None) -> list[LedgerRow]:
    return [evaluate(claim, records) for claim in (claims() if entries is None else entries)]


def ledger_markdown(rows: list[LedgerRow]) -> str:
    lines = ["# Claims ledger", "",
             "Generated by `kestrel matrix --write docs/cookbook` from `kestrel/cookbook/data/claims.json`, the "
             "evidence records and the planner; do not edit by hand. Statuses:", ""]
    lines += [f"- **{name}**: {meaning}." for name, meaning in STATUS_MEANINGS.items()]
    lines += ["", "Roofline checks count the fewest bytes any engine could read, so *Consistent* means \"not ruled "
              "out\", not \"confirmed\".", "",
              "| Claim | Source | Conditions | Status | Why |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.claim} | {row.source or 'no public source found'} | {row.conditions} | "
                     f"**{row.status}** | {row.reason} |")
    return "\n".join(lines) + "\n"
