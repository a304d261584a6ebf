"""C++ kernels for the CPU, for loops that torch.compile does not write well; torch.ops.kestrel_cpu once loaded.

- `expert_matvec(x, expert, w, scale=None)` (expert_matvec.cpp): out[p] = w[expert[p]] @ x[p] for P token-expert
  pairs, x float32 [P, in], expert int64 [P], w float32 or bfloat16 [E, out, in], or MXFP4 (kestrel.quant.mxfp4:
  codes uint8 [E, out, in / 2] with scale uint8 [E, out, in / 32]) -> float32 [P, out]. Each expert's rows are read
  once for all of its pairs (MXFP4 ones decoded in registers).
- `expert_mlp(z, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, situ, beta, linear_beta)`
  (expert_matvec.cpp): the routed experts of T tokens whole, sum_j weights[t, j] * w2[e] act(w1[e] z[t], w3[e] z[t])
  over e = ids[t, j] -> float32 [T, D]: expert_matvec's three products, glu's activation (glu.h) and the weighted
  sum in one call (w3 None: w1 is the dense [E, 2I, D] of both); kestrel.ops.torch.moe runs the routed experts on it.
- `kda_decode_step_(qkv, gate_raw, beta_raw, out_gate, conv_weight, A_log, dt_bias, norm_weight, lower_bound,
  norm_eps, conv_pool, state_pool, slots, use_state, scale)` (kda_decode_step.cpp): one decode token of a KDA layer
  for N sequences, float32, from the q, k, v projections qkv [N, 3*H*D] before the short conv to the gated output
  norm -> o [N, H, D], the conv and recurrent states updated in place in conv_pool [slots, W-1, 3*H*D] and
  state_pool [slots, H, D, D] at slots [N] (read as zeros where use_state [N] is false); each state crosses memory
  once each way. kestrel.ops.torch.kda_decode runs a decode step on it.
- `kda_chunk_terms(q, k, v, g, beta)` (kda_chunk_terms.cpp): the intra-chunk terms of KDA's chunked prefill for B
  chunks of C tokens and H heads, float32 q (scaled), k, g [B, H, C, K], v [B, H, C, V], beta [B, H, C] ->
  kestrel.ops.torch.kda.IntraChunkTerms' six tensors, one task per chunk and head; chunk_kda takes them from it.
- `indexer_topk(q, weights, keys, key_scales, page_table, page_size, seq_index, positions, topk)`
  (indexer_topk.cpp): the lightning indexer's topk positions [T, topk] int64 (best first, -1 past the visible keys)
  for T query tokens, q [T, H, D], weights [T, H] fp32, scored against the paged index-key cache (keys [R, D] in
  the model dtype, or FP8 E4M3 with key_scales [R]) over positions 0..positions[t] of sequence seq_index[t], without
  a [T, context] score matrix; its scores are the batch-invariant products' (kestrel.ops.batch_invariant).
  kestrel.ops.torch.paged_indexer runs the indexer's selection on it.
- `paged_mla(q, values, scales, page_table, page_size, seq_index, positions, scale, value_dim, selected)`
  (paged_mla.cpp): absorbed-form MLA attention for T float32 query tokens q [T, H, Dk] straight from the paged latent
  cache (values [R, Dk] float32, bfloat16, or FP8 E4M3 with scales [R]), over each token's positions
  0..positions[t] or its `selected` [T, K] ones, each row read in place once per token for all heads, with an online
  softmax -> [T, H, value_dim]; kestrel.ops.torch.paged_attention runs MLA decode and paged prefill on it.
- `linear_rows(x, w, bias=None)` (linear_rows.cpp): x float32 [M, in] @ w [out, in]^T + bias [out] -> [M, out],
  each weight read from memory once for up to 64 rows of x (32 with AVX2) and broadcast against a vector of them;
  kestrel.layers.linear multiplies a batched decode step's rows by the large weights on it.
- `linear_dots(x, w, bias=None)` (linear_dots.cpp): x float32 [M <= 4, in] (rows contiguous) @ w [out, in]^T +
  bias [out] -> [M, out] as dot products along the input dim, each weight read once into a whole vector; the
  eager products of a decode step of up to 4 sequences (kestrel.layers.linear).
- `attn_res_mix_norm(sources, mix_norm_weight, proj_weight, mix_eps, norm_weight, norm_eps)`
  (attn_res_mix_norm.cpp): AttnRes's softmax mix of float32 sources [S, T, D] over depth and the RMSNorm after it
  -> [T, D], one pass per source and token; kestrel.ops.torch.attn_res runs the eager mix on it.
- `rms_norm(x, weight, eps)` (rms_norm.cpp): float32 rows x [M, D] (strided rows allowed) * rsqrt(mean x^2 + eps)
  * weight [D] -> [M, D]; kestrel.layers.norm runs the eager RMSNorm on it.
- `glu(gate, up, situ, beta, linear_beta)` (glu.cpp): the gated MLP activation of float32 rows [M, I], SiLU(gate) *
  up or SiTU-GLU -> [M, I]; kestrel.ops.torch.moe.GLUActivation runs it eagerly on it.
- `invariant_mm(a, b)` (invariant_mm.cpp): a float32 [M, K] @ b [K, N] (rows contiguous) -> [M, N], or batched
  [B, M, K] @ [B, K, N] -> [B, M, N], every output one
  fused multiply-add per input from zero, k ascending, as linear_rows sums too: the batch-invariant GEMM of
  kestrel.ops.batch_invariant (deterministic inference).

`load()` builds them on first use with the machine's C++ compiler (`$CXX`, else `c++`: the one inductor needs too) for
the vector ISA inductor picks on this CPU (remembered per CPU beside the libraries, so that later processes skip
importing inductor), with the flags its own generated code gets (-ffp-contract=off among them: each kernel rounds where
its source says, with fused multiply-adds where it calls them), into `~/.cache/kestrel/cpu-kernels` (`$XDG_CACHE_HOME`
if set): one library per sources, flags and torch version, shared by processes (built once: the sources compiled as one
translation unit per core, at once, ~25 s on 2 cores; a build removes all but the KEEP most recently used), and tags
inductor's cache keys with the library's, so that no graph compiled against other kernels calls these. Where no ISA is
found or the build fails it returns False (logged once), and callers take their torch paths, which compute the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from ..tracing import constant_when_traced

log = logging.getLogger("kestrel")

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kestrel" / "cpu-kernels"
_loading = threading.Lock()
KEEP = 8
"""Libraries kept in CACHE (one per kestrel version, CPU and torch that ran here lately): the most recently used."""


def load() -> bool:
    """Whether the kernels are loaded into torch.ops.kestrel_cpu (with their fakes for tracing), building them on
    the first call (one thread builds; the others wait for it: a background compile may ask at the same time)."""
    if _loaded:                 # asked on every eager op: no lock once loaded
        return True
    with _loading:
        return _load()


@cache
def _load() -> bool:
    try:
        isa_flags = _isa_flags()            # (inductor's pick raises a RuntimeError without a working compiler)
        if isa_flags:
            library = _build(isa_flags)
            torch.ops.load_library(library)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:    # the torch paths compute the same
        detail = getattr(e, "stderr", None) or str(e)
        log.warning("kestrel's CPU kernels failed to build, using the torch paths: %s", detail.strip()[-2000:])
        return False
    if not isa_flags:
        log.warning("kestrel's CPU kernels: inductor found no vector ISA on this CPU; using the torch paths.")
        return False
    # Inductor's on-disk cache keys a compiled graph by its FX code, in which a call of these ops reads the same
    # whatever their schemas: tagging the keys with the library's own key keeps a graph compiled against other
    # kernels (an older kestrel's) from calling these with its arguments.
    torch.compiler.config.cache_key_tag += f"+{library.stem}"

    @torch.library.register_fake("kestrel_cpu::expert_matvec")
    def _(x, expert, w, scale=None):
        return x.new_empty(x.shape[0], w.shape[1])

    @torch.library.register_fake("kestrel_cpu::expert_mlp")
    def _(z, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, situ, beta, linear_beta):
        return z.new_empty(z.shape)

    @torch.library.register_fake("kestrel_cpu::linear_rows")
    def _(x, w, bias=None):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("kestrel_cpu::linear_dots")
    def _(x, w, bias=None):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("kestrel_cpu::attn_res_mix_norm")
    def _(sources, mix_norm_weight, proj_weight, mix_eps, norm_weight, norm_eps):
        return sources.new_empty(sources.shape[1:])

    @torch.library.register_fake("kestrel_cpu::invariant_mm")
    def _(a, b):
        return a.new_empty(*a.shape[:-1], b.shape[-1])

    @torch.library.register_fake("kestrel_cpu::indexer_topk")
    def _(q, weights, keys, key_scales, page_table, page_size, seq_index, positions, topk):
        return page_table.new_empty(q.shape[0], topk)

    @torch.library.register_fake("kestrel_cpu::rms_norm")
    def _(x, weight, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("kestrel_cpu::glu")
    def _(gate, up, situ, beta, linear_beta):
        return gate.new_empty(gate.shape)

    @torch.library.register_fake("kestrel_cpu::paged_mla")
    def _(q, values, scales, page_table, page_size, seq_index, positions, scale, value_dim, selected):
        return q.new_empty(q.shape[0], q.shape[1], value_dim)

    @torch.library.register_fake("kestrel_cpu::kda_chunk_terms")
    def _(q, k, v, g, beta):
        chunks = q.shape[:3]
        return (q.new_empty(q.shape), q.new_empty(*chunks, q.shape[2]), q.new_empty(q.shape), v.new_empty(v.shape),
                q.new_empty(q.shape), q.new_empty(*q.shape[:2], q.shape[3]))

    @torch.library.register_fake("kestrel_cpu::kda_decode_step_")
    def _(qkv, gate_raw, beta_raw, out_gate, conv_weight, A_log, dt_bias, norm_weight, lower_bound, norm_eps,
          conv_pool, state_pool, slots, use_state, scale):
        return gate_raw.new_empty(gate_raw.shape)

    global _loaded
    _loaded = True
    return True


_loaded = False


_enabled = True


def set_enabled(enabled: bool) -> None:
    """Let callers take the kernels (the default), or make `available` say no, so that every op takes its torch
    path (`--disable-cpu-kernels`; process-wide). Deterministic inference's products load them regardless."""
    global _enabled
    _enabled = enabled


@constant_when_traced
def available() -> bool:
    """Whether callers take the kernels: enabled, and load() (a constant to torch.compile's tracing)."""
    return _enabled and load()


def _isa_flags() -> list[str]:
    """The compiler flags of the vector ISA inductor picks on this CPU (its arch flags, then its macros as -D flags;
    empty where it finds none). Remembered in CACHE per CPU (its /proc/cpuinfo flags), compiler, torch version and
    ATEN_CPU_CAPABILITY (what the pick depends on), so that a process that finds them there never imports inductor
    (~2 s of start-up)."""
    try:
        cpu_flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        cpu_flags = None
    compiler = os.environ.get("CXX", "c++")
    key = hashlib.sha256(repr((cpu_flags, compiler, shutil.which(compiler), torch.__version__,
                               os.environ.get("ATEN_CPU_CAPABILITY"))).encode()).hexdigest()[:16]
    memo = CACHE / f"isa-{key}.json"
    if cpu_flags is not None:
        with contextlib.suppress(OSError, ValueError):          # none remembered yet, or a damaged memo
            return json.loads(memo.read_text())
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    flags = [*isa.build_arch_flags().split(), *(f"-D{m}" for m in isa.build_macro())] if isa else []
    if cpu_flags is not None:
        with contextlib.suppress(OSError):
            CACHE.mkdir(parents=True, exist_ok=True)
            partial = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(flags))
            partial.replace(memo)
    return flags


def _build(isa_flags: list[str]) -> Path:
    """The kernels' shared library for these flags, compiled into CACHE unless there already; written under a
    temporary name and renamed, so that processes building at once each load a whole library."""
    from torch.utils.cpp_extension import include_paths, library_paths

    libraries = library_paths()
    compile_flags = ["-fPIC", "-std=c++20", "-O3", "-ffp-contract=off", "-fopenmp", *isa_flags,
                     f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                     *(f"-I{p}" for p in include_paths())]
    link_flags = ["-shared", "-fopenmp", *(f"-L{p}" for p in libraries), *(f"-Wl,-rpath,{p}" for p in libraries),
                  "-lc10", "-ltorch_cpu"]
    key = hashlib.sha256(b"".join(source.read_bytes() for source in [*SOURCES, *HEADERS])
                         + " ".join([torch.__version__, *compile_flags, *link_flags]).encode()).hexdigest()[:16]
    target = CACHE / f"kestrel_cpu-{key}.so"
    if target.exists():
        with contextlib.suppress(OSError):      # marks it used (for prune); a read-only shared cache is fine
            os.utime(target)
    else:
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        _compile(SOURCES, partial, compile_flags, link_flags)
        partial.replace(target)
        prune(CACHE, KEEP)
    return target


def _compile(sources: list[Path], library: Path, compile_flags: list[str], link_flags: list[str]) -> None:
    """Compile the sources as one translation unit per core at most (each #includes its share of them, so that
    torch's headers, most of a unit's time, are parsed once per unit; each source keeps its code in a namespace of its
    own), the units at once, and link them into library."""
    compiler = os.environ.get("CXX", "c++")

    def run(arguments: list[str]) -> None:
        subprocess.run([compiler, *arguments], check=True, capture_output=True, text=True)

    units = _units(sources, len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory(dir=library.parent) as folder, ThreadPoolExecutor(len(units)) as pool:
        paths = [Path(folder) / f"unit{i}.cpp" for i in range(len(units))]
        for path, unit in zip(paths, units):
            path.write_text("".join(f'#include "{source}"\n' for source in unit))
        list(pool.map(lambda path: run(["-c", str(path), "-o", str(path.with_suffix(".o")), *compile_flags]), paths))
        run([*(str(path.with_suffix(".o")) for path in paths), "-o", str(library), *link_flags])


def _units(sources: list[Path], count: int) -> list[list[Path]]:
    """sources in at most `count` groups of about equal size in bytes (each, largest first, to the smallest group)."""
    size = {source: source.stat().st_size for source in sources}
    units: list[list[Path]] = [[] for _ in range(min(count, len(sources)))]
    for source in sorted(sources, key=size.get, reverse=True):
        min(units, key=lambda unit: sum(map(size.get, unit))).append(source)
    return units


def prune(cache: Path, keep: int) -> None:
    """Remove all but the `keep` most recently used (modified) libraries from cache; builds under way (their
    temporary names) stay. A process that loaded a removed library keeps its mapping."""
    used = {}
    for library in cache.glob("kestrel_cpu-*.so"):
        with contextlib.suppress(OSError):          # another process's prune may remove it first
            used[library] = library.stat().st_mtime
    for old in sorted(used, key=used.get, reverse=True)[keep:]:
        with contextlib.suppress(OSError):
            old.unlink()
