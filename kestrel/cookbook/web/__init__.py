"""The cookbook web page: static HTML/JS/CSS (in static/) plus one generated data.js holding every recipe, plan,
matrix row and ledger row the page shows, so the page needs no server logic and no network.

`build_site(out_dir)` writes the files; `site_files()` returns them in memory (path -> (bytes, content type)) for
a server to answer `/cookbook/<path>` with (index.html for the bare folder). Every number the page shows is
computed here by the planner; the page only looks them up.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from ..calculator import MODES, SPEC_MODES, ratio_text
from ..evidence import DEFAULT_EVIDENCE_DIR, load_records
from ..hardware import catalog
from ..ledger import ledger_rows
from ..matrix import matrix_rows
from ..planner import HICACHE_CHOICES, Plan, plan
from ..recipe_request import QUANTS, STRATEGIES, RecipeRefused, RecipeRequest
from ..recipes import Recipe, make_recipe
from ..sglang_recipe import supported_devices
from ..text import roofline_caption

STATIC_DIR = Path(__file__).parent / "static"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8"}
MODELS = ("k3", "k3.1-pro")
LENGTHS = (2048, 8192, 11264, 32768, 131072, 1048576)
DEFAULT_LENGTH = 11264
RATIO_PLACEHOLDER = "{{ratio}}"
DEFAULT_QUANT = "default"


class _Strings:
    """Interns repeated strings: the data refers to them by index."""

    def __init__(self) -> None:
        self.values: list[str] = []
        self._index: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        if text not in self._index:
            self._index[text] = len(self.values)
            self.values.append(text)
        return self._index[text]


def _combination_key(*parts: str) -> str:
    return "|".join(parts)


def _rounded(value: float | None) -> int | None:
    return None if value is None else round(value)


def _plan_numbers(result: Plan, strings: _Strings) -> dict[str, Any]:
    """What changes with the request length: the pinned ratio, the pools and the roofline (tok/s rounded)."""
    pools = result.pools
    return {
        "ratio": ratio_text(result.ratio),
        "state_slots": pools.state_slots if pools else None,
        "kv_tokens": pools.kv_tokens if pools else None,
        "admitted": result.admitted_requests,
        "fits": result.fits,
        "fit_reason": strings(result.fit_reason),
        "roofline_caption": strings(roofline_caption(result)),
        "roofline": [[s.batch, _rounded(s.tokens_per_s_per_user), _rounded(s.tokens_per_s_per_device), c.kv_context,
                      c.indexer_context] for s, c in zip(result.roofline, result.crossovers)],
    }


def _plan_entry(result: Plan, strings: _Strings) -> dict[str, Any]:
    """A plan's length-independent numbers, and its length-dependent ones for every LENGTHS value."""
    request = result.request
    by_length = {}
    for length in LENGTHS:
        variant = result if length == request.avg_request_len else plan(
            replace(request, avg_request_len=length, context=None, compare_devices=False))
        by_length[str(length)] = _plan_numbers(variant, strings)
    return {
        "device": strings(f"{result.device.id}: {result.device.name}"),
        "memory": strings(result.device.fact("memory").describe()),
        "bandwidth": strings(result.device.fact("memory_bandwidth").describe()),
        "layout": f"{request.layout.describe()} = {result.nodes.ranks} ranks on {result.nodes.describe()}",
        "weights_per_gpu": result.weight_bytes_per_rank_total,
        "weights_by_class": result.weight_bytes_per_rank,
        "kv_per_token": result.kv_bytes_per_token,
        "kv_per_token_per_rank": round(result.kv_bytes_per_token_per_rank),
        "state_per_slot": result.state_bytes_per_slot,
        "state_per_slot_per_rank": result.state_bytes_per_slot_per_rank,
        "slots_per_request": result.slots_per_request,
        "verify_states": result.verify_states,
        "min_devices": result.min_devices,
        "unknowns": [strings(f"{u.fact}: blocks {', '.join(u.blocks)}") for u in result.unknowns],
        "notes": [strings(n) for n in result.notes],
        "by_length": by_length,
    }


def _recipe_entry(recipe: Recipe, strings: _Strings, plan_index: int) -> dict[str, Any]:
    pinned = f"--mamba-full-memory-ratio {recipe.ratio_text}"
    templated = f"--mamba-full-memory-ratio {RATIO_PLACEHOLDER}"
    commands = {engine: {"lines": [strings(line.replace(pinned, templated)) for line in command.lines],
                         "image": command.image, "strategy": command.strategy,
                         "notes": [strings(n) for n in command.notes]}
                for engine, command in recipe.commands.items()}
    return {"id": recipe.id, "lane": recipe.lane, "status": recipe.sglang_status, "nodes": recipe.nodes,
            "per_node": recipe.per_node, "commands": commands,
            "refusals": {engine: strings(reason) for engine, reason in recipe.refusals.items()},
            "notes": [strings(n) for n in recipe.notes], "plan": plan_index}


def _generator_data() -> dict[str, Any]:
    """Every combination of the generator's options: a recipe index, or the index of the refusal's reason."""
    strings = _Strings()
    recipes: list[dict[str, Any]] = []
    plans: list[dict[str, Any]] = []
    plan_ids: dict[Any, int] = {}
    combinations: dict[str, int] = {}
    for model, hardware, mode, strategy, spec, hicache, quant in itertools.product(
            MODELS, supported_devices(), MODES, STRATEGIES, SPEC_MODES, HICACHE_CHOICES, (DEFAULT_QUANT, *QUANTS)):
        key = _combination_key(model, hardware, mode, strategy, spec, hicache, quant)
        request = RecipeRequest(model=model, hardware=hardware, mode=mode, strategy=strategy, spec=spec,
                                hicache=hicache, quant=None if quant == DEFAULT_QUANT else quant,
                                avg_request_len=DEFAULT_LENGTH)
        try:
            recipe = make_recipe(request)
        except RecipeRefused as refused:
            combinations[key] = -1 - strings(str(refused))
            continue
        plan_request = recipe.plan.request
        if plan_request not in plan_ids:
            plan_ids[plan_request] = len(plans)
            plans.append(_plan_entry(recipe.plan, strings))
        combinations[key] = len(recipes)
        recipes.append(_recipe_entry(recipe, strings, plan_ids[plan_request]))
    options = {"model": list(MODELS), "hardware": [[d, catalog()[d].name] for d in supported_devices()],
               "mode": list(MODES), "strategy": list(STRATEGIES), "spec": list(SPEC_MODES),
               "hicache": list(HICACHE_CHOICES), "quant": [DEFAULT_QUANT, *QUANTS], "length": list(LENGTHS)}
    return {"options": options, "default_length": DEFAULT_LENGTH, "ratio_placeholder": RATIO_PLACEHOLDER,
            "strings": strings.values, "combinations": combinations, "recipes": recipes, "plans": plans}


@cache
def _generator_json() -> str:
    return json.dumps(_generator_data(), separators=(",", ":"))


def site_data(evidence_dir: Path = DEFAULT_EVIDENCE_DIR) -> dict[str, Any]:
    """Everything the page shows: the generator's combinations, the matrix and the ledger."""
    records = load_records(evidence_dir)
    data = json.loads(_generator_json())
    data["matrix"] = [{"recipe": r.recipe, "lane": r.lane, "badge": r.badge, "sglang_status": r.sglang_status,
                       "summary": r.summary, "evidence": list(r.evidence)} for r in matrix_rows(records)]
    data["ledger"] = [{"claim": r.claim, "source": r.source, "conditions": r.conditions, "status": r.status,
                       "reason": r.reason} for r in ledger_rows(records)]
    return data


def site_files(evidence_dir: Path = DEFAULT_EVIDENCE_DIR) -> dict[str, tuple[bytes, str]]:
    """The page's files by relative path ("index.html", "app.js", "style.css", "data.js") with content types."""
    files = {path.name: (path.read_bytes(), CONTENT_TYPES[path.suffix]) for path in STATIC_DIR.iterdir()
             if path.suffix in CONTENT_TYPES}
    script = "window.COOKBOOK = " + json.dumps(site_data(evidence_dir), separators=(",", ":")) + ";\n"
    files["data.js"] = (script.encode(), CONTENT_TYPES[".js"])
    return files


def build_site(out_dir: Path, evidence_dir: Path = DEFAULT_EVIDENCE_DIR) -> Path:
    """Write the page's files into out_dir; returns the path of index.html."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, (content, _) in site_files(evidence_dir).items():
        (out_dir / name).write_bytes(content)
    return out_dir / "index.html"
