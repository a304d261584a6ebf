"""The serving facts the recipes and the calculator build on, read once from `data/anchors.json`."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

ANCHORS_FILE = Path(__file__).parent / "data" / "anchors.json"


@cache
def anchors() -> dict[str, Any]:
    """The parsed anchors file (treat as read-only)."""
    return json.loads(ANCHORS_FILE.read_text())


def calculator_constants() -> dict[str, Any]:
    """SGLang's mamba-ratio calculator constants (draft KV bytes, default request length, ...)."""
    return anchors()["sglang_calculator"]
