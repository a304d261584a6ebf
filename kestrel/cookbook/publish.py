"""The cookbook's generated Markdown under docs/cookbook/: the verification matrix, the claims ledger and the
hardware catalog, each derived from records and data files only."""

from __future__ import annotations

from pathlib import Path

from .evidence import DEFAULT_EVIDENCE_DIR, load_records
from .hardware import catalog
from .ledger import ledger_markdown, ledger_rows
from .matrix import matrix_markdown, matrix_rows

CATALOG_COLUMNS = (("memory", "Memory"), ("memory_bandwidth", "Bandwidth"), ("bf16_dense", "BF16 dense"),
                   ("fp8_dense", "FP8 dense"), ("fp4_dense", "FP4 dense"), ("scale_up_bandwidth", "Scale-up"),
                   ("devices_per_node", "Per node"))


def _cell(fact) -> str:
    if fact.value is None:
        return f"{fact.flag} ({fact.source})"
    text = f"{fact.value:g} {fact.unit} — {fact.flag}: {fact.source}"
    if fact.alternatives:
        text += "; conflicting: " + "; ".join(f"{a.value:g} {a.unit} ({a.flag}: {a.source})"
                                              for a in fact.alternatives)
    return text


def hardware_markdown() -> str:
    lines = ["# Hardware catalog", "",
             "Generated from `kestrel/cookbook/data/hardware.json` (carried over from "
             "`../shared/reference/hardware.md`); do not edit by hand. Every number carries its source and a flag: "
             "*vendor claim*, *measured* (third-party measurement) or *third-party report*; *unknown* means no public "
             "source, *none* that the device lacks the capability. Throughput is dense TFLOPS.", "",
             "| Device | " + " | ".join(title for _, title in CATALOG_COLUMNS) + " |",
             "|---" * (len(CATALOG_COLUMNS) + 1) + "|"]
    for device in catalog().values():
        cells = [_cell(device.fact(key)) for key, _ in CATALOG_COLUMNS]
        lines.append(f"| **{device.id}** {device.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_docs(out_dir: Path, evidence_dir: Path = DEFAULT_EVIDENCE_DIR) -> list[Path]:
    """Write matrix.md, claims.md and hardware.md into out_dir; returns the paths."""
    records = load_records(evidence_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pages = {"matrix.md": matrix_markdown(matrix_rows(records)), "claims.md": ledger_markdown(ledger_rows(records)),
             "hardware.md": hardware_markdown()}
    for name, text in pages.items():
        (out_dir / name).write_text(text)
    return [out_dir / name for name in pages]
