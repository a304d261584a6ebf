"""C++ kernels for the CPU, for loops that torch.compile does not write well.

- `kestrel_cpu::expert_matvec(x, expert, w)` (expert_matvec.cpp): out[p] = w[expert[p]] @ x[p] for P token-expert
  pairs, x float32 [P, in], expert int64 [P], w float32 or bfloat16 [E, out, in] -> float32 [P, out]. Each expert's
  rows are read once for all of its pairs; kestrel.ops.torch.moe runs the routed experts' products on it.

`expert_matvec()` builds them on first use with torch.utils.cpp_extension (the machine's C++ compiler, into torch's
cache of built extensions, shared by processes and rebuilt only when the source or flags change; ~25 s on 2 cores)
for the vector ISA inductor picks on this CPU, with the flags its own generated code gets. Where no ISA is found or
the build fails it returns None (logged once), and callers take their torch path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("kestrel")

SOURCE = Path(__file__).with_name("expert_matvec.cpp")


@cache
def expert_matvec() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """torch.ops.kestrel_cpu.expert_matvec, built and registered (with its fake for tracing) on first call; None
    where it cannot be built here."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch.utils.cpp_extension import load

    isa = pick_vec_isa()
    if not isa:
        log.warning("kestrel's CPU kernels: inductor found no vector ISA on this CPU; using the torch paths.")
        return None
    flags = ["-O3", "-fopenmp", *isa.build_arch_flags().split(), *(f"-D{macro}" for macro in isa.build_macro())]
    try:
        load("kestrel_cpu", [str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception as e:                      # no compiler, say: the torch paths compute the same
        log.warning("kestrel's CPU kernels failed to build, using the torch paths: %s", e)
        return None

    @torch.library.register_fake("kestrel_cpu::expert_matvec")
    def _(x, expert, w):
        return x.new_empty(x.shape[0], w.shape[1])

    return torch.ops.kestrel_cpu.expert_matvec


@torch.compiler.assume_constant_result
def expert_matvec_available() -> bool:
    """Whether expert_matvec() is built here (building it on first call); a constant to torch.compile's tracing."""
    return expert_matvec() is not None
