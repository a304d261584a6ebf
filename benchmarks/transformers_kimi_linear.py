"""transformers' Kimi-Linear modeling module on its torch path, for baselines.

With fla importable, transformers routes KDA to fla's Triton kernels (which cannot run on a CPU); the choice is
made when the module is imported, so fla is hidden while it is (re)imported.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def load() -> ModuleType:
    """transformers.models.kimi_linear.modeling_kimi_linear, imported with fla hidden."""
    hidden = {name: module for name, module in sys.modules.items() if name == "fla" or name.startswith("fla.")}
    for name in [n for n in sys.modules if n.startswith("transformers.models.kimi_linear")]:
        del sys.modules[name]
    sys.modules["fla"] = None
    try:
        return importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)
