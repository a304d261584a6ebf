"""Which implementation runs each op: the Triton kernel on CUDA tensors when triton imports, the torch reference
otherwise, unless a choice is forced.

Ops come in families that one flag forces together (`--attention-backend triton`, `--moe-backend torch`, ...):

    kda:        kda_decode, kda_prefill
    attention:  paged_mla_decode, paged_indexer_scores, paged_indexer_topk
    moe:        moe_experts
    norm:       attn_res_mix_norm

A family's choice is "auto", "torch" or "triton": set by `set_backend`, else by the environment variable
KESTREL_OPS_BACKEND (for every family), else "auto". The two implementations of an op share one signature.
Inside kestrel.ops.batch_invariant's `invariant()` (deterministic inference), the ops it lists in INVARIANT_OPS run its
batch-invariant implementations instead, on the CPU.
"triton" on CPU tensors runs the kernels through Triton's interpreter, which needs TRITON_INTERPRET=1 set before
`kestrel.ops.triton` is first imported.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch

from . import batch_invariant

AUTO, TORCH, TRITON = "auto", "torch", "triton"
CHOICES = (AUTO, TORCH, TRITON)
ENV_VAR = "KESTREL_OPS_BACKEND"


@dataclass(frozen=True)
class OpEntry:
    """Where an op lives: its family, and its module under kestrel.ops.torch and under kestrel.ops.triton."""

    family: str
    torch_module: str
    triton_module: str


OPS = {
    "kda_decode": OpEntry("kda", "kda_decode", "kda_decode"),
    "kda_prefill": OpEntry("kda", "kda_prefill", "kda_prefill"),
    "paged_mla_decode": OpEntry("attention", "paged_attention", "mla_decode"),
    "paged_indexer_scores": OpEntry("attention", "paged_indexer", "indexer"),
    "paged_indexer_topk": OpEntry("attention", "paged_indexer", "indexer"),
    "moe_experts": OpEntry("moe", "moe", "moe"),
    "attn_res_mix_norm": OpEntry("norm", "attn_res", "attn_res"),
}
FAMILIES = tuple(dict.fromkeys(entry.family for entry in OPS.values()))

_chosen: dict[str, str] = {}


def set_backend(choice: str | None, family: str | None = None) -> None:
    """Force `choice` ("auto", "torch" or "triton") for one family, or for all when family is None; None clears
    the setting, so the family follows KESTREL_OPS_BACKEND again."""
    if choice is not None and choice not in CHOICES:
        raise ValueError(f"unknown ops backend {choice!r}; choose one of {', '.join(CHOICES)}.")
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown op family {family!r}; choose one of {', '.join(FAMILIES)}.")
    for name in (FAMILIES if family is None else (family,)):
        if choice is None:
            _chosen.pop(name, None)
        else:
            _chosen[name] = choice


def family_choice(family: str) -> str:
    """The family's choice: set_backend's, else KESTREL_OPS_BACKEND's, else "auto"."""
    choice = _chosen.get(family) or os.environ.get(ENV_VAR, AUTO)
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r} is not an ops backend; set it to one of {', '.join(CHOICES)}.")
    return choice


@cache
def triton_available() -> bool:
    """Whether triton imports here."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def backend_for(op: str, device: torch.device | str) -> str:
    """"torch" or "triton": the implementation of `op` that runs for tensors on `device`."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; the dispatched ops are {', '.join(OPS)}.")
    device = torch.device(device)
    choice = family_choice(OPS[op].family)
    if choice == AUTO:
        return TRITON if device.type == "cuda" and triton_available() else TORCH
    if choice == TRITON:
        if not triton_available():
            raise RuntimeError(f"the triton backend was chosen for {op}, but triton does not import; install "
                               "triton or choose the torch backend.")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"the triton backend runs {op} on CPU tensors only under Triton's interpreter; set "
                               "TRITON_INTERPRET=1 before starting, or choose the torch backend.")
    return choice


_modules: dict[tuple[str, str], ModuleType] = {}
"""(op, backend) -> the module implementing it, once imported (torch.compile traces a lookup, not an import)."""


def get_op(op: str, device: torch.device | str) -> Callable:
    """The function implementing `op` for tensors on `device` (see backend_for; batch-invariant ones inside
    batch_invariant.invariant())."""
    if op in batch_invariant.INVARIANT_OPS and batch_invariant.active():
        return batch_invariant.INVARIANT_OPS[op]
    key = (op, backend_for(op, device))
    if key not in _modules:
        module = OPS[op].torch_module if key[1] == TORCH else OPS[op].triton_module
        _modules[key] = importlib.import_module(f"kestrel.ops.{key[1]}.{module}")
    return getattr(_modules[key], op)
