"""Training throughput on the CPU: tools/train_tiny.py's training step against transformers' KimiLinearForCausalLM.

One run, same machine, same batches (16 windows of 256 tokens of the bundled model's training data), fp32:
- kestrel: `train_tiny.Trainer.step` on the bundled model's configuration (AttnRes, latent SiTU MoE, lower-bounded
  KDA gate, full-rank output gate, lightning indexer, MTP layer), in its dense phase (next-token + MTP losses) and
  its sparse phase (indexer top-k active, plus the indexer's KL loss and its optimizer);
- transformers: `KimiLinearForCausalLM` with the closest configuration it can express: the same vocabulary, widths,
  layer pattern, heads, latents, experts (32, top-2, one shared) and dense first layer, but no AttnRes, no latent
  MoE (its experts run at the hidden size), SwiGLU instead of SiTU, Kimi-Linear's unbounded decay gate and low-rank
  output gate, no indexer and no MTP layer; next-token loss, backward, AdamW step. Its KDA runs on its torch path
  (fla hidden, see transformers_kimi_linear.py).
Median seconds per step after a warm-up step; tokens/s count the 4,096 predicted tokens per step. Other processes
share these machines' cores, so the load average before and after is printed with the table.
Writes the section "training" of docs/benchmarks.md.

Run: .venv/bin/python benchmarks/bench_train.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from benchmarks import transformers_kimi_linear  # noqa: E402
from benchmarks.report import machine, markdown_table, takes_no_options, write_section  # noqa: E402
from corpus import load_corpus  # noqa: E402
from tiny_config import SEQ_LEN, text_config  # noqa: E402
from tiny_data import TrainingData  # noqa: E402
from tiny_tokenizer import special_ids, train_tokenizer  # noqa: E402
from train_tiny import Recipe, Trainer, new_model  # noqa: E402

STEPS = 4
COMMAND = ".venv/bin/python benchmarks/bench_train.py"
SHIPPED_EVAL = ROOT / "models" / "k3.1-tiny" / "eval.json"


def median_step_seconds(step: Callable[[int], None], first: int) -> float:
    """Median wall time of STEPS calls step(first + 1 ...) after one warm-up call step(first)."""
    step(first)
    times = []
    for i in range(first + 1, first + 1 + STEPS):
        began = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def transformers_step(model, data: TrainingData, batch_size: int) -> Callable[[int], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def step(index: int) -> None:
        windows = data.batch(index, batch_size)
        logits = model(input_ids=windows[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def kestrel_step(trainer: Trainer, data: TrainingData, batch_size: int) -> Callable[[int], None]:
    return lambda index: trainer.step(index, data.batch(index, batch_size))


def shipped_run_line() -> str:
    if not SHIPPED_EVAL.is_file():
        return ""
    training = json.loads(SHIPPED_EVAL.read_text())["training"]
    rate = training["training_tokens"] / training["training_seconds"]
    return (f"The shipped model's own run (`tools/train_tiny.py`, {training['recipe']['steps']:,} steps) took "
            f"{training['training_seconds'] / 60:.0f} minutes of wall time ({training['training_cpu_seconds'] / 60:.0f} "
            f"CPU-minutes) for {training['training_tokens'] / 1e6:.1f}M tokens: {rate:,.0f} tokens/s on average, "
            "on cores shared with other work.")


def main() -> None:
    recipe = Recipe()
    corpus = load_corpus(ROOT / ".cache" / "corpus")
    tokenizer = train_tokenizer((w.text for w in corpus.train), recipe.vocab_size)
    special = special_ids(tokenizer)
    data = TrainingData(corpus.train, tokenizer, SEQ_LEN, recipe.chat_fraction, recipe.seed)
    tokens = recipe.batch_size * SEQ_LEN
    load_before = os.getloadavg()[0]
    trainer = Trainer(new_model(special, recipe.seed), recipe)
    sparse_start = recipe.indexer_warmup_start + recipe.indexer_warmup_steps
    dense = median_step_seconds(kestrel_step(trainer, data, recipe.batch_size), 0)
    sparse = median_step_seconds(kestrel_step(trainer, data, recipe.batch_size), sparse_start)
    baseline = transformers_kimi_linear.closest_model(text_config(special))
    theirs = median_step_seconds(transformers_step(baseline, data, recipe.batch_size), 0)
    load_after = os.getloadavg()[0]
    rows = [["kestrel `train_tiny` step, dense phase (next-token + MTP)", f"{dense:.2f}", f"{tokens / dense:,.0f}",
             f"{theirs / dense:.1f}x"],
            ["kestrel `train_tiny` step, sparse phase (+ indexer top-k, KL, its optimizer)", f"{sparse:.2f}",
             f"{tokens / sparse:,.0f}", f"{theirs / sparse:.1f}x"],
            ["transformers `KimiLinearForCausalLM`, closest config (next-token)", f"{theirs:.2f}",
             f"{tokens / theirs:,.0f}", "1.0x"]]
    table = markdown_table(["training step", "s / step", "tokens / s", "speed vs transformers"], rows)
    print(table)
    body = "\n\n".join(filter(None, [
        "## Training throughput (CPU)",
        f"`{COMMAND}`; {machine()}; load average {load_before:.1f} before, {load_after:.1f} after (2 cores).",
        f"One step = {recipe.batch_size} packed windows of {SEQ_LEN} tokens of the bundled model's training data, "
        "fp32, forward, backward and AdamW; median of "
        f"{STEPS} steps after a warm-up step. kestrel runs the bundled model's configuration; transformers' "
        "`KimiLinearForCausalLM` runs the closest one it can express (same widths, layer pattern, heads, latents, "
        "32 experts top-2 plus a shared one, dense first layer; but no AttnRes, experts at the hidden size instead "
        "of a latent space, SwiGLU instead of SiTU, Kimi-Linear's unbounded decay gate and low-rank output gate, "
        "no indexer, no MTP layer: less work per step than kestrel's).",
        table,
        shipped_run_line(),
    ]))
    write_section("training", body)


if __name__ == "__main__":
    takes_no_options(__doc__)
    main()
