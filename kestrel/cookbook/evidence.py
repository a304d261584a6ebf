"""Evidence records: one JSON file per verification run under `evidence/`, saying what ran where and what it
measured. The verification matrix and the claims ledger are derived from these files only.

A record holds the recipe id, the machine's hardware fingerprint and the catalog id it maps to, software
versions, the git commit (and whether the tree had local changes), the exact command, the engine arguments, the
benchmark results and the accuracy check: a dict with at least "check" (its name), "value", "reference",
"tolerance" (relative) and "passed", or None where nothing was checked (random weights).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..engine.cache.planner import device_memory
from .hardware import CPU, device_for_cuda_name

SCHEMA = "kestrel.evidence/1"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_EVIDENCE_DIR = REPO_ROOT / "evidence"
_PACKAGES = ("kestrel", "torch", "numpy", "safetensors", "tokenizers")


@dataclass
class Record:
    """One verification run (see the module docstring)."""

    recipe: str
    hardware_id: str                       # catalog id, or "cpu"
    hardware: dict[str, Any]               # the fingerprint
    software: dict[str, str]
    git: dict[str, Any]
    command: str
    created: str                           # UTC, ISO 8601
    engine_args: dict[str, Any]
    benchmark: dict[str, Any] | None
    accuracy: dict[str, Any] | None
    schema: str = SCHEMA
    path: Path | None = field(default=None, compare=False)

    @property
    def speed_recorded(self) -> bool:
        return bool(self.benchmark)

    @property
    def accuracy_passed(self) -> bool:
        return bool(self.accuracy and self.accuracy.get("passed"))

    @property
    def accuracy_summary(self) -> str:
        """'heldout_perplexity 71.94 vs 71.94 (tolerance 0.1%) passed', or '' when nothing was checked."""
        if not self.accuracy:
            return ""
        a = self.accuracy
        verdict = "passed" if self.accuracy_passed else "failed"
        return f"{a['check']} {a['value']:.2f} vs {a['reference']:.2f} (tolerance {a['tolerance']:.1%}) {verdict}"

    @property
    def provenance(self) -> str:
        """'commit 1a2b3c4d5e6f', with ' (uncommitted changes)' when the tree was dirty, or 'no git commit'."""
        commit = self.git.get("commit")
        if not commit:
            return "no git commit"
        return f"commit {commit[:12]}" + (" (uncommitted changes)" if self.git.get("dirty") else "")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("path")
        return d


def fingerprint() -> tuple[str, dict[str, Any]]:
    """(catalog id or "cpu", a description of this machine: CPU model, cores, memory, accelerators, OS)."""
    cpu_model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    hardware = {"cpu": cpu_model, "cpu_cores": os.cpu_count(),
                "memory_bytes": device_memory(torch.device("cpu")),
                "accelerators": gpus, "platform": platform.platform(),
                "load_average_1m": os.getloadavg()[0]}   # other work on the machine slows the benchmark
    if not gpus:
        return CPU, hardware
    device = device_for_cuda_name(gpus[0])
    return (device.id if device else f"cuda:{gpus[0]}"), hardware


def software_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for package in _PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    """The checkout's commit and whether it has local changes (read-only git queries). Changes under evidence/ do
    not count: they are the records themselves, not code that ran."""
    def run(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout
    try:
        changes = run("status", "--porcelain", "--", ".", f":(exclude){DEFAULT_EVIDENCE_DIR.name}")
        return {"commit": run("rev-parse", "HEAD").strip(), "dirty": bool(changes.strip())}
    except (OSError, subprocess.CalledProcessError) as e:
        return {"commit": None, "error": f"not a git checkout ({e.__class__.__name__})"}


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def file_name(record: Record) -> str:
    """'<recipe slug>--<hardware>--<time>.json', safe on every file system."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", record.recipe)
    stamp = record.created.replace("-", "").replace(":", "")
    return f"{slug}--{record.hardware_id}--{stamp}.json"


def write_record(record: Record, directory: Path = DEFAULT_EVIDENCE_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(record)
    path.write_text(json.dumps(record.as_dict(), indent=2) + "\n")
    record.path = path
    return path


def read_record(path: Path) -> Record:
    """Read one record; a ValueError names the file and what is wrong with it."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSON file ({e}).") from None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a kestrel evidence record (schema {SCHEMA} expected).")
    try:
        return Record(**raw, path=path)
    except TypeError as e:
        raise ValueError(f"{path} does not have the fields of a {SCHEMA} record ({e}).") from None


def load_records(directory: Path = DEFAULT_EVIDENCE_DIR) -> list[Record]:
    """Every record under `directory`, oldest first (none when it does not exist)."""
    if not directory.is_dir():
        return []
    return sorted((read_record(p) for p in directory.glob("*.json")), key=lambda r: r.created)
