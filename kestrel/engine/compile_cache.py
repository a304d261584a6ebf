"""Where torch.compile's generated code is cached on disk, and its size bound.

Inductor keeps what it generates (C++ sources, shared libraries, the graphs that call them) in
`$TORCHINDUCTOR_CACHE_DIR`; its own default is under /tmp, which a reboot empties. Unless that variable is set,
kestrel points it at `~/.cache/kestrel/inductor` (`$XDG_CACHE_HOME` if set), so that a restarted server loads its
graphs instead of generating them again (on the bundled model, two cores: ~35 s per decode graph cold, ~10 s warm).
Inductor keys every entry by everything that changes it: the traced graph (the model's shapes, dtypes and the
engine's flags shape it), its own configuration, the torch version, the C++ compiler and the CPU's vector ISA, and
kestrel's CPU kernel library (kestrel.ops.cpu tags the keys with it); an entry it cannot load is skipped and
rebuilt. Entries refer to one another, so the bound is kept whole: a cache found larger than
`KESTREL_COMPILE_CACHE_GB` (default 4) at start-up is emptied and filled again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("kestrel")

DEFAULT_BOUND_GB = 4.0


def use_compile_cache() -> Path:
    """Point inductor at kestrel's cache directory (unless TORCHINDUCTOR_CACHE_DIR is set), empty it if over its
    bound, and return it."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kestrel" / "inductor"
    folder = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default)))
    bound = _bound_gb() * 2**30
    size = cache_bytes(folder)
    if size > bound:
        log.info("compile cache: %s holds %.1f GB, over its bound of %.1f GB (KESTREL_COMPILE_CACHE_GB); emptied",
                 folder, size / 2**30, bound / 2**30)
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def cache_bytes(folder: Path) -> int:
    """The bytes of the files under folder (0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):        # removed meanwhile by another process
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _bound_gb() -> float:
    """KESTREL_COMPILE_CACHE_GB, or DEFAULT_BOUND_GB; a ValueError (one sentence) if it is not a number >= 0."""
    value = os.environ.get("KESTREL_COMPILE_CACHE_GB", str(DEFAULT_BOUND_GB))
    try:
        bound = float(value)
    except ValueError:
        bound = -1.0
    if not bound >= 0:
        raise ValueError(f"KESTREL_COMPILE_CACHE_GB must be a number of GB (0 or more), got {value!r}.")
    return bound
