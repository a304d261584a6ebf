"""float32 linear layers on the CPU: kestrel.layers.linear.linear against F.linear (torch's own GEMM), one run.

Weights of the 437M K3 in benchmarks/bench_llamacpp.py that reach BLOCKED_MIN_WEIGHT (its LM head [32000, 1024], its
dense MLP's gate and up projections [5632, 1024]) and one of 1024 x 1024 below it, times 1 to 32 rows: the rows of a
batched decode step or of a verification of a few drafts per sequence. At 1 and 2 torch threads; each point the
median of ROUNDS calls after a warm-up, the two alternating. "kestrel's path" names what linear runs there (F.linear,
oneDNN, blocked_linear or the linear_rows kernel); "max |diff|" is the largest difference of its output from
F.linear's. Where oneDNN runs, also kestrel's Linear once `pack_onednn_weights` has packed its weight (the engine's
layout), against F.linear. Then the layout `hold_column_major` chooses: F.linear against the same weight held
column-major, for the bundled model's shapes and ones either side of the rule (COLUMN_MAJOR_SHAPES), at 1, 5, 8 and
32 rows.
Writes the section "linear" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_linear.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import machine, markdown_table, takes_no_options, write_section  # noqa: E402
from kestrel.layers import linear as linear_module  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_linear.py"
ROUNDS = 15
SHAPES = {"LM head [32000, 1024]": (32000, 1024), "MLP gate/up [5632, 1024]": (5632, 1024),
          "attention [1024, 1024]": (1024, 1024)}
ROWS = (1, 3, 4, 8, 12, 15, 16, 32)
COLUMN_MAJOR_SHAPES = {"bundled attention [192, 192]": (192, 192), "bundled draft MLP [768, 192]": (768, 192),
                       "bundled LM head [4096, 192]": (4096, 192), "[1024, 256]": (1024, 256),
                       "[4, 192]": (4, 192), "[1024, 512]": (1024, 512), "[256, 1024]": (256, 1024)}
COLUMN_MAJOR_ROWS = (1, 5, 8, 32)
THREADS = (1, 2)


def path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which GEMM kestrel's linear ran for x times weight."""
    ran = []
    saved = linear_module.blocked_linear, linear_module.onednn_linear, linear_module.linear_rows
    linear_module.blocked_linear = lambda *args: ran.append("blocked") or saved[0](*args)
    linear_module.onednn_linear = lambda *args: ran.append("oneDNN") or saved[1](*args)
    linear_module.linear_rows = lambda *args: ran.append("linear_rows") or saved[2](*args)
    try:
        linear_module.linear(x, weight)
    finally:
        linear_module.blocked_linear, linear_module.onednn_linear, linear_module.linear_rows = saved
    return ran[0] if ran else "F.linear"


def milliseconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def medians(first, second) -> tuple[float, float]:
    """Median milliseconds of ROUNDS calls of each, alternating, after one call of each."""
    first(), second()
    times = [(milliseconds(first), milliseconds(second)) for _ in range(ROUNDS)]
    return tuple(statistics.median(column) for column in zip(*times))


def layouts(generator: torch.Generator) -> list[list]:
    """Rows of the layout table: F.linear against each COLUMN_MAJOR_SHAPES weight held row- and column-major."""
    table = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        for name, shape in COLUMN_MAJOR_SHAPES.items():
            weight = torch.randn(*shape, generator=generator) * shape[1] ** -0.5
            column_major = weight.t().contiguous().t()
            for rows in COLUMN_MAJOR_ROWS:
                x = torch.randn(rows, shape[1], generator=generator)
                row_ms, column_ms = medians(lambda: F.linear(x, weight), lambda: F.linear(x, column_major))
                diff = float((F.linear(x, column_major) - F.linear(x, weight)).abs().max())
                table.append([threads, name, rows, "yes" if linear_module.column_major_pays(weight) else "no",
                              f"{1e3 * row_ms:,.1f}", f"{1e3 * column_ms:,.1f}", f"{row_ms / column_ms:.2f}x",
                              f"{diff:.1e}"])
                print(table[-1], flush=True)
    return table


@torch.inference_mode()
def main() -> None:
    load_before = os.getloadavg()[0]
    generator = torch.Generator().manual_seed(0)
    table = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        for name, shape in SHAPES.items():
            weight = torch.randn(*shape, generator=generator) * shape[1] ** -0.5
            module = linear_module.Linear(shape[1], shape[0], bias=False)
            module.weight.data = weight
            linear_module.pack_onednn_weights(module)
            for rows in ROWS:
                x = torch.randn(rows, shape[1], generator=generator)
                ours, theirs = (lambda: linear_module.linear(x, weight)), (lambda: F.linear(x, weight))
                mine, torch_ms = medians(ours, theirs)
                diff = float((ours() - theirs()).abs().max())
                packed = ["-", "-"]
                if module.packed is not None:
                    packed_ms, torch_ms_again = medians(lambda: module(x), theirs)
                    packed = [f"{packed_ms:,.3f}", f"{torch_ms_again / packed_ms:.2f}x"]
                table.append([threads, name, rows, path(x, weight), f"{torch_ms:,.3f}", f"{mine:,.3f}",
                              f"{torch_ms / mine:.2f}x", *packed, f"{diff:.1e}"])
                print(table[-1], flush=True)
    layout_table = layouts(generator)
    load_after = os.getloadavg()[0]
    body = "\n\n".join([
        "## float32 linear layers on the CPU (linear)",
        "`kestrel.layers.linear.linear` against `F.linear` (torch's GEMM: MKL's sgemm on these builds) for weights "
        "of the 437M K3 of the llamacpp section, times 1 to 32 rows (a batched decode step's, or a verification's "
        "few drafts per sequence). Where MKL runs, kestrel multiplies "
        f"{linear_module.BLOCKED_ROWS[0]}-{linear_module.BLOCKED_ROWS[1]} rows against weights of at least "
        f"{linear_module.BLOCKED_MIN_WEIGHT:,} elements by blocks of {linear_module.BLOCK} weight rows in one "
        "batched GEMM (`blocked_linear`), since MKL streams the whole weight once per two or three of those rows, "
        f"and {linear_module.ROWS_KERNEL[0]}-{linear_module.ROWS_KERNEL[1]} rows against weights of at least "
        f"{linear_module.ROWS_KERNEL_MIN_WEIGHT:,} elements on kestrel's C++ kernel (`linear_rows`: each weight read "
        "once for all rows; chosen by times with the weights coming from memory, where these come from cache); "
        "on CPUs that prefer oneDNN, weights of at least "
        f"{linear_module.ONEDNN_MIN_WEIGHT:,} elements take oneDNN (this machine: "
        f"{'oneDNN' if linear_module.ONEDNN else 'MKL'}), from a copy of the weight in oneDNN's own layout "
        "(`pack_onednn_weights`, \"packed\") at more than one row, and weights of at least "
        f"{linear_module.PACKED_MIN_WEIGHT:,} from the packed copy at {linear_module.PACKED_MIN_ROWS} rows or more. "
        "Milliseconds per call, medians of "
        f"{ROUNDS} calls, the two alternating.",
        f"{machine().split(',')[0]}, torch {torch.__version__}, at "
        f"{' and '.join(map(str, THREADS))} torch threads (the table's first column); load average "
        f"{load_before:.1f} before, {load_after:.1f} after on {os.cpu_count()} cores shared with other work, so compare "
        "the ratios, not the absolute times.",
        markdown_table(["threads", "weight", "rows", "kestrel's path", "F.linear ms", "kestrel ms", "speedup",
                        "kestrel, packed ms", "packed speedup", "max |diff|"], table),
        "### Column-major weights",
        "For eager inference kestrel holds the float32 weights that `linear` leaves to F.linear column-major (same "
        "shape and values, transposed storage; `hold_column_major`) where they have at most "
        f"{linear_module.COLUMN_MAJOR_MAX_IN} input features and at least {linear_module.COLUMN_MAJOR_MIN_OUT} "
        "outputs (\"held\"). F.linear against the weight held row-major (as stored) and column-major, the bundled "
        "model's shapes and ones either side of the rule; microseconds per call, medians of "
        f"{ROUNDS} calls, the two alternating.",
        markdown_table(["threads", "weight", "rows", "held", "row-major us", "column-major us", "speedup",
                        "max |diff|"], layout_table),
        f"Rerun: `{COMMAND}`",
    ])
    write_section("linear", body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
