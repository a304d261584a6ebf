"""kestrel's benchmark card on this machine: the bundled model served by `kestrel serve` (its defaults), measured
by `kestrel bench serve` with the random and agentic workloads over a concurrency sweep, plus its held-out
perplexity through the API (`kestrel eval perplexity`, prompt logprobs) against the model card's number.

Everything runs through the command line, exactly as a user would run it. The card (Markdown and PNG plots) and
the raw result JSONs go to docs/bench-card/; the card is also written into the section "card" of
docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_card.py
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_server import wait_until_up  # noqa: E402
from benchmarks.report import machine, takes_no_options, write_section  # noqa: E402
from kestrel.engine.args import BUNDLED_MODEL  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_card.py"
PORT = 8767
URL = f"http://127.0.0.1:{PORT}"
OUT = ROOT / "docs" / "bench-card"
CONCURRENCY = "1,2,4,8"
WORKLOADS = {
    "random": ["--workload", "random", "--num-prompts", "16", "--input-len", "128", "--output-len", "32",
               "--range-ratio", "0.5"],
    "agentic": ["--workload", "agentic", "--num-prompts", "24", "--sessions", "6", "--length-scale", "512",
                "--think-scale", "0.05", "--max-context", "1536"],
}


def kestrel(*args: str) -> str:
    """Run the kestrel CLI; its stdout."""
    done = subprocess.run([sys.executable, "-m", "kestrel.cli", *args], check=True, capture_output=True, text=True)
    return done.stdout


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    server = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", "--port", str(PORT)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_up(URL)
        for name, args in WORKLOADS.items():
            kestrel("bench", "serve", "--base-url", URL, "--max-concurrency", CONCURRENCY,
                    "--output", str(OUT / "results" / name), *args)
        card_numbers = json.loads((BUNDLED_MODEL / "eval.json").read_text())
        sample, seq_len = card_numbers["sample"], card_numbers["protocol"]["seq_len"]
        perplexity = json.loads(kestrel("eval", "perplexity", "--base-url", URL,
                                        "--file", str(BUNDLED_MODEL / sample["file"])))
    finally:
        server.terminate()
        server.wait(60)
    hardware = f"{platform.machine()} CPU, 2 cores (this development machine)"
    recipe = "`kestrel serve` with no arguments: the bundled k3.1-tiny, its dtype (bf16 + MXFP4 experts), defaults"
    kestrel("bench", "card", *map(str, sorted(OUT.glob("results/*/*.json"))), "--output", str(OUT),
            "--hardware", hardware, "--recipe", recipe)
    card = (OUT / "card.md").read_text().replace("# Benchmark card\n", "", 1)
    card = card.replace("](", "](bench-card/")            # the plots, relative to docs/
    body = "\n\n".join([
        "## Benchmark card: the bundled model on this machine's CPU",
        f"Measured with `kestrel bench serve` against `kestrel serve` on loopback (concurrencies {CONCURRENCY}); "
        "raw results and plots in `docs/bench-card/`. The machine's two cores are shared by the server and the "
        "load generator.",
        machine(),
        card.strip(),
        f"Held-out perplexity through the API (`kestrel eval perplexity`: echo with prompt logprobs, windows of "
        f"up to 2,048 tokens) on `{sample['file']}`: **{perplexity['perplexity']:.2f}** over "
        f"{perplexity['tokens']:,} tokens, served in the checkpoint's bf16; the model card measures "
        f"{sample['perplexity']:.2f} in float32 with its own protocol (windows of {seq_len} tokens after `[BOS]`), "
        f"{100 * (perplexity['perplexity'] / sample['perplexity'] - 1):+.2f}% apart.",
        f"Rerun: `{COMMAND}`",
    ])
    write_section("card", body)
    print(body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
