"""What a recipe is asked for (RecipeRequest, named by its id) and how a generator declines it (RecipeRefused); the
types recipes.py and the per-engine generators (sglang_recipe.py, vllm_recipe.py) share."""

from __future__ import annotations

from dataclasses import dataclass

from .calculator import MODES, SPEC_MODES
from .hardware import CPU, catalog
from .planner import HICACHE_CHOICES


class RecipeRefused(ValueError):
    """The anchors do not support this combination; the message says why."""


STRATEGIES = ("low-latency", "high-concurrency", "balanced", "high-throughput")
QUANTS = ("mxfp4", "nvfp4", "w4a8")


@dataclass(frozen=True)
class RecipeRequest:
    """One choice in the generator; `quant` None takes the hardware's default checkpoint, `avg_request_len` None the
    planner's default (see PlanRequest)."""

    model: str = "k3"
    hardware: str = "b300"
    mode: str = "unified"
    strategy: str = "low-latency"
    spec: str = "none"
    hicache: str = "off"
    quant: str | None = None
    avg_request_len: int | None = None

    @property
    def id(self) -> str:
        options = [f"{k}={v}" for k, v in (("spec", self.spec), ("hicache", self.hicache), ("quant", self.quant))
                   if v not in ("none", "off", None)]
        return ",".join([f"{self.model}/{self.hardware}/{self.mode}/{self.strategy}", *options])

    @classmethod
    def from_id(cls, recipe_id: str, avg_request_len: int | None = None) -> RecipeRequest:
        """Parse an id made by `.id`."""
        head, *options = recipe_id.split(",")
        parts = head.split("/")
        if len(parts) != 4:
            raise ValueError(f"a recipe id looks like model/hardware/mode/strategy[,spec=mtp][,hicache=host]"
                             f"[,quant=nvfp4], got {recipe_id!r}.")
        extra = {}
        for option in options:
            key, _, value = option.partition("=")
            if key not in ("spec", "hicache", "quant") or not value:
                raise ValueError(f"unknown recipe option {option!r} in {recipe_id!r}; options are spec=, hicache=, "
                                 "quant=.")
            extra[key] = value
        model, hardware, mode, strategy = parts
        return cls(model=model, hardware=hardware, mode=mode, strategy=strategy, avg_request_len=avg_request_len,
                   **extra)

    def check(self) -> None:
        for name, value, choices in (("mode", self.mode, MODES), ("strategy", self.strategy, STRATEGIES),
                                     ("spec", self.spec, SPEC_MODES), ("hicache", self.hicache, HICACHE_CHOICES)):
            if value not in choices:
                raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}.")
        if self.quant is not None and self.quant not in QUANTS:
            raise ValueError(f"unknown quant {self.quant!r}; choose one of: {', '.join(QUANTS)}.")
        if self.hardware != CPU and self.hardware not in catalog():
            raise ValueError(f"unknown hardware {self.hardware!r}; choose one of: {', '.join([*catalog(), CPU])}.")
