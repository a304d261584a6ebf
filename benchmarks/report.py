"""Writes one benchmark's results into its own section of docs/benchmarks.md.

Each benchmark owns the text between `<!-- begin NAME -->` and `<!-- end NAME -->`; rerunning a
benchmark replaces its section and leaves the others alone.
"""

from __future__ import annotations

import argparse
import platform
import re
from datetime import datetime, timezone
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
THREADS = 1
"""Torch threads for the CPU benchmarks that set it: these machines' two cores are shared with other work, and with
two threads each small op waits for the busier core (decode steps measured 5-30x slower than with one thread)."""
HEADER = "# Benchmarks\n\nEach section is written by the script it names; rerun the script to refresh it.\n"


def machine() -> str:
    """One line describing where the numbers were taken: when, the CPU (which GEMM layout wins can differ between
    CPU models) and the vector instructions torch's kernels use, torch threads and version."""
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    threads = torch.get_num_threads()
    return (f"{when}; {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), "
            f"{threads} torch thread{'' if threads == 1 else 's'}, torch {torch.__version__}")


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the platform's processor or machine name."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the section `name` of docs/benchmarks.md with `body`."""
    text = doc.read_text() if doc.exists() else HEADER
    block = f"<!-- begin {name} -->\n{body.strip()}\n<!-- end {name} -->"
    pattern = re.compile(rf"<!-- begin {re.escape(name)} -->.*?<!-- end {re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def takes_no_options(doc: str) -> None:
    """The command line of a benchmark without options: -h/--help prints its docstring `doc` and exits; any other
    argument is refused (exit 2) rather than ignored by a run that starts anyway."""
    argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
