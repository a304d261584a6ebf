"""Every recipe the generator can emit, against a committed golden file, so any change to a command shows in review.

The golden file lists each distinct command line, note and refusal once under a short key (the first 10 hex digits of
its SHA-1, so unrelated changes do not renumber it), then one line per offered combination of model x hardware x mode
x strategy x speculation x HiCache x quantization (at the default request length) naming its lane, SGLang's badge,
layout, pinned ratio, admitted requests and the keys of its commands per engine, then the CPU recipes. After an
intended change, refresh it with `.venv/bin/python tests/cookbook/test_cookbook_golden.py` and review the diff.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from pathlib import Path
from unittest import mock

from kestrel.cookbook import hardware, planner
from kestrel.cookbook.calculator import MODES, SPEC_MODES
from kestrel.cookbook.planner import HICACHE_CHOICES
from kestrel.cookbook.recipe_request import QUANTS, STRATEGIES, RecipeRefused, RecipeRequest
from kestrel.cookbook.recipes import ENGINES, Recipe, base_requests, make_recipe
from kestrel.cookbook.sglang_recipe import supported_devices

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "cookbook" / "golden" / "recipes.txt"
REFRESH = ".venv/bin/python tests/cookbook/test_cookbook_golden.py"
MODELS = ("k3", "k3.1-pro")
CPU_RAM = 24 * 2**30
"""The RAM the CPU recipes plan for (they read the machine's own): pinned, so that the file is the same on every
machine that runs the test."""


class Keys:
    """Texts by short content key, each listed once in the golden file."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        key = hashlib.sha1(text.encode()).hexdigest()[:10]
        self.texts[key] = text
        return key


def all_requests() -> list[RecipeRequest]:
    """Every combination of the generator's options, then the CPU recipes."""
    combos = itertools.product(MODELS, supported_devices(), MODES, STRATEGIES, SPEC_MODES, HICACHE_CHOICES,
                               (None, *QUANTS))
    cpu = [r for r in base_requests() if r.hardware == "cpu"]
    return [*(RecipeRequest(*combo) for combo in combos), *cpu]


def recipe_line(recipe: Recipe, keys: Keys) -> str:
    plan = recipe.plan
    parts = [recipe.id, f"lane {recipe.lane}", f"SGLang page: {recipe.sglang_status or '-'}",
             f"{plan.request.layout.describe()} on {recipe.nodes} x {recipe.per_node}", f"ratio {recipe.ratio_text}",
             f"admitted {plan.admitted_requests}"]
    for engine in ENGINES:
        if engine in recipe.refusals:
            parts.append(f"{engine} refused {keys(recipe.refusals[engine])}")
            continue
        command = recipe.commands[engine]
        parts.append(f"{engine} [{command.image or '-'}] {' '.join(keys(line) for line in command.lines)} notes "
                     f"{' '.join(keys(note) for note in command.notes) or '-'}")
    parts.append(f"notes {' '.join(keys(note) for note in recipe.notes) or '-'}")
    return " | ".join(parts)


def golden_text() -> str:
    keys, refusals, lines = Keys(), Keys(), []
    planner.plan.cache_clear()      # plans are cached per request: none planned with this machine's RAM is reused
    try:
        with mock.patch.object(hardware, "device_memory", lambda device: CPU_RAM):
            for request in all_requests():
                try:
                    lines.append(recipe_line(make_recipe(request), keys))
                except RecipeRefused as refused:
                    refusals(str(refused))
    finally:
        planner.plan.cache_clear()  # nor is one planned with the pinned RAM left to other tests
    header = [f"# Every recipe the generator emits ({len(lines)} offered). Refresh after an intended change: {REFRESH}",
              "", "## Commands and notes"]
    texts = [f"{key} {text}" for key, text in sorted(keys.texts.items())]
    reasons = [f"{key} {text}" for key, text in sorted(refusals.texts.items())]
    return "\n".join([*header, *texts, "", "## Recipes", *lines, "", "## Refusal reasons", *reasons]) + "\n"


def test_every_recipe_matches_the_golden_file():
    expected = GOLDEN.read_text() if GOLDEN.is_file() else ""
    actual = golden_text()
    if actual != expected:
        changed = [line for line in set(actual.splitlines()) ^ set(expected.splitlines())]
        raise AssertionError(f"{len(changed)} golden lines differ (e.g. {sorted(changed)[:3]}); if the change is "
                             f"intended, run `{REFRESH}` and review the diff of {GOLDEN.relative_to(ROOT)}.")


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(golden_text())
    print(f"wrote {GOLDEN}", file=sys.stderr)


# The golden file against SGLang's, vLLM's and SGLang's router's own argument parsers: `make check-recipes`
# (tools/check_upstream_parsers.py) installs them and records what they reject, with the sha256 of the golden file it
# checked. Installing them takes minutes, so the suite checks the record instead of running the parsers.
UPSTREAM_CHECK = ROOT / "tests" / "cookbook" / "golden" / "upstream_check.json"


def test_the_golden_file_was_parsed_by_the_upstream_parsers():
    import json

    record = json.loads(UPSTREAM_CHECK.read_text())
    digest = hashlib.sha256(GOLDEN.read_bytes()).hexdigest()
    assert record["golden_sha256"] == digest, (
        f"the golden file changed without a new upstream check ({UPSTREAM_CHECK.relative_to(ROOT)} was made for "
        f"another {GOLDEN.name}): run `make check-recipes`")
    rejected = [f"{r['recipe']}: {r['message']}" for entry in record.values()
                if isinstance(entry, dict) and "rejections" in entry for r in entry["rejections"]]
    assert not rejected, (f"the upstream parsers reject {len(rejected)} cookbook commands (e.g. {rejected[:3]}); fix "
                          f"the cell tables, refresh the golden file, then run `make check-recipes`")
    assert isinstance(record.get("sglang"), dict) and record["sglang"]["argument_lists_parsed"] > 0, (
        "the upstream check parsed no SGLang command: run `make check-recipes`")
